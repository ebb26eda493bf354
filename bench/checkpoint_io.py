"""Checkpoint save/load throughput next to a raw fsspec copy of the same bytes to the same place.

    .venv/bin/python bench/checkpoint_io.py                       # file:// under /tmp
    .venv/bin/python bench/checkpoint_io.py --moto                # S3 API: moto server on loopback
    .venv/bin/python bench/checkpoint_io.py --storage s3://bucket/prefix --endpoint-url URL

"save" is the real path (reflow.tasks.checkpoint.save): every trainer rank runs DeepSpeed's
save_checkpoint and writes the HF folder to a local temp dir, hashes and uploads each file, then
the driver commits (MANIFEST, COMMITTED, latest). "load" is the real resume path
(reflow.tasks.checkpoint.load_first_valid): validate, download + sha256-check, engine.load_checkpoint.
"raw" is `fs.put` / `fs.get` of the identical files to/from the same storage root. ratio = ours /
raw time (1.0 = no overhead beyond moving the bytes). Not a test; numbers depend on the machine.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def _policy(out: Path, hidden: int, layers: int) -> Path:
    from reflow.rl.demo_policy import build_model, build_tokenizer, save_policy

    tok = build_tokenizer()
    return save_policy(build_model(tok, hidden=hidden, layers=layers, heads=max(1, hidden // 64),
                                   mlp=4 * hidden), tok, out)


def _batch(tok):
    from reflow.rl.types import RolloutBatch

    ids = [tok("12+34=", add_special_tokens=False)["input_ids"]] * 4
    resp = [tok("46", add_special_tokens=False)["input_ids"]] * 4
    return RolloutBatch(group_index=[0, 0, 1, 1], prompt_text=["12+34="] * 4, prompt_ids=ids,
                        response_text=["46"] * 4, response_ids=resp, rollout_logprobs=[[0.0] * len(r) for r in resp],
                        finish_reason=["stop"] * 4, label=[None] * 4, advantages=[1.0, -1.0, 0.5, -0.5])


def _trainers(policy: Path, ranks: int, zero: int):
    import ray

    from reflow.engines.hf_io import load_tokenizer
    from reflow.engines.train.group import TrainerGroup
    from reflow.engines.train.settings import RankSettings
    from reflow.rl.losses import LossSettings

    group = TrainerGroup.create(ranks, "bench-ckpt", "bench", model_path=str(policy),
                                settings=RankSettings(zero_stage=zero, lr=1e-4, total_steps=10, micro_batch_size=4))
    tok = load_tokenizer(str(policy))
    ray.get(group.train_iteration(_batch(tok), minibatches=1, pad_id=tok.pad_token_id,
                                  loss=LossSettings(kl_estimator="k1")))  # optimizer state exists now
    return group


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(args) -> None:
    import ray

    from reflow.infra.store import checkpoint as ckpt
    from reflow.infra.store.storage import ExperimentStore
    from reflow.tasks.checkpoint import load_first_valid, save

    work = Path(tempfile.mkdtemp(prefix="reflow-bench-"))
    ray.init(num_cpus=max(4, args.ranks + 1), include_dashboard=False, _temp_dir=str(work / "ray"),
             log_to_driver=False)
    group = _trainers(_policy(work / "policy", args.hidden, args.layers), args.ranks, args.zero)
    store = ExperimentStore.open(args.storage, f"bench-{os.getpid()}", endpoint_url=args.endpoint_url)
    store.preflight()
    rows = {"save": [], "raw_put": [], "load": [], "raw_get": []}
    for r in range(args.repeat):
        step = r + 1
        rows["save"].append(_timed(lambda: save(group, store, step, ckpt.state_for(step, 1, 0, args.ranks),
                                                "bench: true\n", keep_last=1)))
        ck = ckpt.at_step(store, step)
        files = ckpt.check(ck)
        local = work / f"copy{r}"
        store.fs.get(store._path(ck.prefix) + "/", str(local), recursive=True)  # the same bytes, untimed
        raw = store._path(f"raw/{r}")
        rows["raw_put"].append(_timed(lambda: store.fs.put(str(local) + "/", raw + "/", recursive=True)))
        rows["load"].append(_timed(lambda: load_first_valid(group, [(ck, files)], args.ranks)))
        rows["raw_get"].append(_timed(lambda: store.fs.get(raw + "/", str(work / f"back{r}"), recursive=True)))
        store.rm(f"raw/{r}", recursive=True)
    nbytes = sum(m["bytes"] for m in files.values())
    _report(args, nbytes, rows)
    store.rm("", recursive=True)
    ray.shutdown()
    shutil.rmtree(work, ignore_errors=True)


def _report(args, nbytes: int, rows: dict[str, list[float]]) -> None:
    med = {k: statistics.median(v) for k, v in rows.items()}
    mb = nbytes / 2**20
    print(f"checkpoint: {mb:.1f} MiB in total ({args.ranks} rank(s), ZeRO-{args.zero}, hidden={args.hidden}, "
          f"layers={args.layers}); storage {args.storage}; median of {args.repeat}")
    print(f"{'':6} {'ours s':>8} {'ours MiB/s':>11} {'raw s':>8} {'raw MiB/s':>10} {'ratio':>6}")
    for ours, raw in (("save", "raw_put"), ("load", "raw_get")):
        print(f"{ours:6} {med[ours]:8.2f} {mb / med[ours]:11.1f} {med[raw]:8.2f} {mb / med[raw]:10.1f} "
              f"{med[ours] / med[raw]:6.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--storage", default=None, help="storage root (default: file:// temp dir; s3:// with --moto)")
    p.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint")
    p.add_argument("--moto", action="store_true", help="start moto's S3 server on loopback and use it")
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3])
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.moto:
        from tests.ckpt_fixtures import LoopbackS3

        server = LoopbackS3().start()
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            os.environ.setdefault(k, "bench")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        import s3fs

        s3fs.S3FileSystem(endpoint_url=server.url).mkdir("reflow-bench")
        args.storage, args.endpoint_url = "s3://reflow-bench/runs", server.url
    args.storage = args.storage or f"file://{tempfile.mkdtemp(prefix='reflow-bench-store-')}"
    run(args)


if __name__ == "__main__":
    main()
