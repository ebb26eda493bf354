"""CUDA IPC weight payloads (engines/weights/buckets.py), as far as a machine without a GPU can check them.

The transfer itself runs on a GPU only (bench/gpu.py measures it and reads pushed tensors back). Here:
the wire form a sender writes (torch's rebuild_cuda_tensor named, the GPU named by UUID as SGLang's
senders do), and what an engine does with such a payload before it touches CUDA: a payload over the
engine's size cap, a malformed one, or any CUDA payload on an engine with no GPU is refused with a
message that names the way out, and nothing is mapped.
"""
from __future__ import annotations

import base64
import io
import pickle

import pytest
import torch

from reflow.engines.weights import buckets as B

STORAGE_HANDLE, EVENT = b"h" * 64, b"e" * 64


class _CudaTensor:
    """Pickles as a CUDA tensor would: torch's rebuild function and its 15 arguments."""

    def __init__(self, **changes):
        args = dict(tensor_cls=torch.Tensor, size=torch.Size([1024]), stride=(1,), offset=0,
                    storage_cls=torch.storage.UntypedStorage, dtype=torch.uint8, device="GPU-0f0e-uuid",
                    handle=STORAGE_HANDLE, nbytes=1024, storage_offset=0, requires_grad=False,
                    ref_counter=b"/torch_refcount", ref_offset=0, event=EVENT, event_sync=True)
        args.update(changes)
        self.args = tuple(args.values())

    def __reduce__(self):
        return B._REBUILD_CUDA, self.args


def _payload(tensor) -> str:
    meta = [B.FlattenedTensorMetadata("w", torch.Size([4, 4]), torch.float32, 0, 64, 64)]
    raw = pickle.dumps({"flattened_tensor": tensor, "metadata": meta}, protocol=4)
    return base64.b64encode(raw).decode()


def test_the_wire_names_torchs_rebuild_and_the_gpu_uuid_for_cuda_tensors():
    """A CPU tensor pickles as before; a CUDA one goes through `_reduce_tensor`, which swaps the device
    index for the UUID (checked on the reduction's output, as no GPU is here to produce a real one)."""
    fn, args = B._reduce_tensor(torch.zeros(3))
    assert fn is not B._REBUILD_CUDA  # CPU: torch's shared-memory reduction, untouched
    real = torch.multiprocessing.reductions.reduce_tensor

    def fake_cuda_reduce(t):
        return torch.multiprocessing.reductions.rebuild_cuda_tensor, _CudaTensor(device=0).args

    torch.multiprocessing.reductions.reduce_tensor = fake_cuda_reduce
    try:
        B._device_uuid, saved = (lambda i: f"GPU-uuid-of-{i}"), B._device_uuid
        fn, args = B._reduce_tensor(torch.zeros(3))
    finally:
        torch.multiprocessing.reductions.reduce_tensor = real
        B._device_uuid = saved
    assert fn is B._REBUILD_CUDA and args[B._CUDA_DEVICE_ARG] == "GPU-uuid-of-0"
    assert (fn.__module__, fn.__name__) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")


@pytest.mark.parametrize("tensor, message", [
    (_CudaTensor(nbytes=1 << 40), "maps more than the 4096-byte limit"),
    (_CudaTensor(nbytes=-1), "makes no sense"),
    (_CudaTensor(tensor_cls=dict), "plain tensors over untyped storages"),
    (_CudaTensor(), "this engine has no GPU"),
])
def test_cuda_payloads_refused_before_anything_is_mapped(tensor, message):
    with pytest.raises(B.BucketError, match=message):
        B.load_payload(_payload(tensor), "flattened_bucket", max_bytes=4096)


def test_a_payload_cannot_smuggle_another_callable_through_the_cuda_rebuild():
    raw = pickle.dumps(_CudaTensor(), protocol=2).replace(b"rebuild_cuda_tensor", b"rebuild_cuda_tensorX")
    with pytest.raises(B.BucketError, match="refused to unpickle global"):
        B.deserialize_bucket(base64.b64encode(raw).decode())
    assert B._SafeUnpickler(io.BytesIO(b"")).find_class("torch.multiprocessing.reductions",
                                                        "rebuild_cuda_tensor") is B._REBUILD_CUDA


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal a GPU-less engine gives")
@pytest.mark.parametrize("device", [0, "GPU-1234", True, None])
def test_gpu_less_engines_name_the_way_out(device):
    with pytest.raises(B.BucketError, match="mode=distributed or disk"):
        B.local_cuda_index(device)


def test_memory_release_on_cpu_only_tracks_tags(tiny_policy):
    from reflow.engines.embedded.generator import Generator
    from reflow.engines.hf_io import load_causal_lm, load_tokenizer

    gen = Generator(load_causal_lm(str(tiny_policy)), load_tokenizer(str(tiny_policy)))
    before = {n: t.clone() for n, t in gen.model.state_dict().items()}
    gen.release_memory({"weights", "kv_cache", "cuda_graph"})
    gen.resume_memory({"weights", "kv_cache", "cuda_graph"})
    assert gen.memory_stats() == {}
    assert all(torch.equal(before[n], t) for n, t in gen.model.state_dict().items())


RECEIVER = r"""
import sys
from reflow.engines.weights.buckets import load_payload
for line in sys.stdin:  # one payload a line; each rebuilt, summed, freed before the next: a long-lived engine
    named = load_payload(line.strip(), "flattened_bucket")
    print(" ".join(f"{n}={float(t.sum())}" for n, t in named), flush=True)
    del named
"""


@pytest.mark.slow  # ~4 s of CPU: make test-fast stays under a minute (receiver processes)
def test_a_reused_buffer_serves_two_long_lived_receivers_for_three_buckets_in_a_row():
    """The regression of the withdrawn reuse: one pickle sent to every receiver let the shared segment's
    count fall to zero while the sender still used it, and the third rebuild found no file. With one
    pickle per receiver the pool's buffer carries three buckets to both receivers, and the data each
    sees is its own bucket's."""
    import subprocess
    import sys

    receivers = [subprocess.Popen([sys.executable, "-c", RECEIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
    pool, storages = B.BufferPool(), set()
    try:
        for k in range(3):
            bucket = B.SharedBucket([("a", torch.full((1024,), float(k + 1))), ("b", torch.arange(8.0) * k)], pool=pool)
            storages.add(id(bucket.flat))  # the pool's buffer this bucket was packed into
            for r, payload in zip(receivers, bucket.payloads(len(receivers))):
                r.stdin.write(payload + "\n")
                r.stdin.flush()
            assert [r.stdout.readline().split() for r in receivers] == [[f"a={1024.0 * (k + 1)}", f"b={28.0 * k}"]] * 2
            bucket.release()
    finally:
        outs = [r.communicate(timeout=60) for r in receivers]
    assert all(r.returncode == 0 for r in receivers), [err[-2000:] for _, err in outs]
    assert len(storages) == 1  # one shared buffer carried all three buckets
