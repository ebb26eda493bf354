"""Colocated mode's optimizer offload where DeepSpeed has none (engines/train/offload.py).

DeepSpeed picks BF16_Optimizer for ZeRO-1 + bf16 + float32 gradient accumulation, and its
engine.offload_states then raises AttributeError (seen on an H200). reflow moves that optimizer's
float32 storages to host memory and back. The same code runs on CPU tensors, so here a real one-rank
DeepSpeed trainer (its own process: DeepSpeed sets up torch.distributed) trains a step, its optimizer
state is offloaded (every storage freed), reloaded (bit-identical, the same tensor objects), and a
second step gives exactly the weights of a twin trainer that never offloaded.
"""
from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = r"""
import hashlib, json, socket, sys, torch
from reflow.engines.train.offload import HostCopies, optimizer_storages
from reflow.engines.train.settings import RankSettings
from reflow.engines.train.trainer import TrainerRank
from tests.test_trainer import PROBLEMS, RANK_KW, _batch, _train_kw
from reflow.engines.hf_io import load_tokenizer

policy, offload, fold = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
rank = TrainerRank(0, 1, "127.0.0.1", port, policy,
                   RankSettings(**(RANK_KW | dict(zero_stage=1, precision="bf16", lr=1e-2))))
folded = "_update_hp_grad" in vars(rank.engine.optimizer)  # ds_rank.fold_grads_in_place
if fold == "deepspeed":  # DeepSpeed's own fold (a float32 copy of each gradient first), for comparison
    del rank.engine.optimizer._update_hp_grad
pad = load_tokenizer(policy).pad_token_id
batch = _batch(policy)
rank.train_iteration(batch, **_train_kw(pad))
opt = rank.engine.optimizer
out = {"optimizer": type(opt).__name__, "deepspeed_offload": hasattr(opt, "offload_states"), "folded": folded}
if offload:
    storages = optimizer_storages(opt, rank.engine.device)
    digest = lambda: [hashlib.sha256(bytes(s.cpu())).hexdigest() for s in storages]  # noqa: E731
    before, ids = digest(), [id(s) for s in storages]
    copies = HostCopies()
    out["moved"] = copies.offload(storages)
    out["left"] = sum(s.nbytes() for s in storages)
    out["params"] = sum(p.numel() for p in rank.engine.module.parameters())
    out["weights_kept"] = all(p.untyped_storage().nbytes() > 0 for p in rank.engine.module.parameters())
    copies.reload()
    out["restored"] = digest() == before and [id(s) for s in optimizer_storages(opt, rank.engine.device)] == ids
    # A checkpoint taken while the state is away (colocated: saves fall between a push and the next rollout)
    # must hold the state itself: torch.save of the emptied storages wrote 0 bytes for full-size tensors and
    # the resume failed in torch.load ("Trying to resize storage that is not resizable", seen on an H200).
    import glob, tempfile
    from reflow.infra.config.schema import StorageConfig
    from reflow.infra.store.storage import ExperimentStore
    rank._move_states(offload=True)
    root = tempfile.mkdtemp()
    store = ExperimentStore.from_config(StorageConfig(root="file://" + root), "x")
    manifest = rank.save_checkpoint(store, "ckpt")
    out["away_after_save"] = sum(s.nbytes() for s in storages) == 0
    saved = [torch.load(f, weights_only=False) for f in glob.glob(root + "/**/*optim_states.pt", recursive=True)]
    out["saved_states_load"] = len(saved)
    rank._move_states(offload=False)
    out["restored_after_save"] = digest() == before
    # A colocated resume loads while the state is away too (the trainers start offloaded: the engines
    # generate first). The loaded state must be the saved one, and leave again after the load.
    rank._move_states(offload=True)
    rank.fetch_checkpoint(store, "ckpt", manifest)
    rank.load_checkpoint()
    out["away_after_load"] = bool(rank._host_states.moved) and not optimizer_storages(opt, rank.engine.device)
    rank._move_states(offload=False)
    storages = optimizer_storages(opt, rank.engine.device)
    out["restored_after_load"] = sorted(digest()) == sorted(before)
rank.train_iteration(batch, **_train_kw(pad))
out["weights"] = rank.weights_checksum()
# The push's list of live parameters: the same object while none moved (the push sender then walks nothing:
# engines/weights/mapped.LiveViews), a new one with the new address once one moved.
views = rank._gathered(keep=True, on_device=True)
out["live_same"] = views is rank._gathered(keep=True, on_device=True)
first = next(rank.engine.module.parameters())
first.data = first.data.clone()
moved_views = rank._gathered(keep=True, on_device=True)
out["live_renewed"] = moved_views is not views and moved_views[0][1].data_ptr() == first.data_ptr() != views[0][1].data_ptr()
# what DeepSpeed would have imported for nothing (ds_rank.import_deepspeed): MLflow, and inductor through Muon
out["imported"] = [m for m in ("mlflow", "torch._inductor.compile_fx") if m in sys.modules]
print("RESULT " + json.dumps(out))
"""


@functools.cache  # one subprocess per variant: the plain run serves the offload test and the fold test alike
def _run(policy: Path, offload: bool, fold: str = "reflow") -> dict:
    repo = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(policy), "1" if offload else "0", fold], cwd=repo,
                       capture_output=True, text=True, timeout=600)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert p.returncode == 0 and line, p.stderr[-3000:]
    return json.loads(line.removeprefix("RESULT "))


def test_bf16_zero1_optimizer_state_leaves_and_returns_bit_exact(tiny_policy):
    moved, plain = _run(tiny_policy, True), _run(tiny_policy, False)
    assert moved["optimizer"] == "BF16_Optimizer" and not moved["deepspeed_offload"]  # why this module exists
    # fp32 master weights, both Adam moments and the fp32 gradient accumulator: >= 16 bytes a parameter
    assert moved["moved"] >= 16 * moved["params"], moved
    assert moved["left"] == 0 and moved["weights_kept"] and moved["restored"]
    assert moved["weights"] == plain["weights"]  # the next step is the one an un-offloaded trainer takes
    assert plain["live_same"] and plain["live_renewed"], plain
    # a CPU rank's start-up without DeepSpeed's MLflow and Muon imports: ~3.5 s of CPU less each (RESULTS 32)
    assert plain["imported"] == [] and moved["imported"] == [], (plain["imported"], moved["imported"])
    # saved while offloaded: the optimizer files load, the state went away again after, and came back intact
    assert moved["saved_states_load"] >= 1 and moved["away_after_save"] and moved["restored_after_save"], moved
    # loaded while offloaded (a colocated resume): the saved state comes back and leaves again
    assert moved["away_after_load"] and moved["restored_after_load"], moved


def test_bf16_gradients_fold_into_float32_in_place_with_deepspeeds_bits(tiny_policy):
    """ds_rank.fold_grads_in_place: the micro-batches' bf16 gradients summed into float32 without DeepSpeed's
    float32 copy of each (less memory traffic per micro-batch on a GPU) give exactly DeepSpeed's weights."""
    ours, theirs = _run(tiny_policy, False), _run(tiny_policy, False, fold="deepspeed")
    assert ours["folded"] and ours["optimizer"] == "BF16_Optimizer"
    assert ours["weights"] == theirs["weights"]


def test_moments_only_offload_leaves_the_master_weights_in_place():
    """ZeRO-3's hand-over moves Adam's moments alone (ds_rank._move_states): a 7B policy's fp32 master partitions
    stay on the GPU, where moving them too filled the H200 machine's host memory (bench/RESULTS.md 32)."""
    import torch

    from reflow.engines.train.offload import HostCopies, optimizer_storages

    class Zero3Like:  # the shape optimizer_storages walks: float32 partitions in attributes, an inner optimizer
        def __init__(self):
            self.fp32_partitioned_groups_flat = [torch.zeros(6), torch.zeros(4)]
            self.optimizer = torch.optim.AdamW(self.fp32_partitioned_groups_flat, lr=0.1)

    opt = Zero3Like()
    for p in opt.fp32_partitioned_groups_flat:
        p.grad = torch.ones_like(p)
    opt.optimizer.step()
    every = optimizer_storages(opt, torch.device("cpu"))
    moments = optimizer_storages(opt, torch.device("cpu"), moments_only=True)
    masters = {p.untyped_storage().data_ptr() for p in opt.fp32_partitioned_groups_flat}
    # the 2 partitions, their 2 moments each and AdamW's float32 step counts / the same without the partitions
    assert len(every) == 8 and len(moments) == 6
    assert masters <= {s.data_ptr() for s in every} and not masters & {s.data_ptr() for s in moments}
    before = [p.clone() for p in opt.fp32_partitioned_groups_flat]
    copies = HostCopies()
    copies.offload(moments)
    assert all(s.nbytes() == 0 for s in moments) and all(p.numel() for p in opt.fp32_partitioned_groups_flat)
    copies.reload()
    assert all(torch.equal(a, b) for a, b in zip(before, opt.fp32_partitioned_groups_flat))


def test_muon_is_imported_without_inductor_where_deepspeed_came_first():
    """transformers' save_pretrained imports deepspeed (a driver or test building a policy did): import_deepspeed
    still imports DeepSpeed's Muon module with its torch.compile decorator made lazy, before a ZeRO engine's sanity
    check would import it with inductor (1.3 of a tiny rank's 1.6 s of CPU to build its engine)."""
    code = ("import sys, deepspeed; from reflow.engines.train.ds_rank import _MUON, import_deepspeed; import_deepspeed(); "
            "print('RESULT', _MUON in sys.modules, 'torch._inductor.compile_fx' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "RESULT True False" in p.stdout, p.stdout[-2000:]
