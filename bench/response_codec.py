"""The /generate answer's encoding and decoding: a rollout batch's per-token log-probs through the json module (what the
embedded engine's server and the rollout client used: Starlette's JSONResponse, httpx's Response.json) against orjson
(what they use now, as SGLang's server does), in the same process, alternating rounds.

    .venv/bin/python bench/response_codec.py                      # 1,024 samples x 400 tokens: the scratchpad shape
    .venv/bin/python bench/response_codec.py --samples 256 --tokens 1000 --rounds 5

The answer is built as the engine builds it (Generator._record's fields through contract.make_response): each sample's
token ids, text and SGLang's [logprob, id, null] triple per token. Prints the seconds of each way and the ratio
(`response_codec: encode_ratio=... decode_ratio=...`, json's time over orjson's; above 1: orjson faster).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402,F401  (puts src/ on the path where reflow is not installed)


def answer(samples: int, tokens: int, seed: int = 0) -> list[dict]:
    from reflow.engines.embedded.contract import make_response
    from reflow.rl.demo_policy import build_tokenizer

    tok, rnd = build_tokenizer(), random.Random(seed)
    out = []
    for i in range(samples):
        ids = [rnd.randrange(3, len(tok)) for _ in range(tokens)]
        lps = [-rnd.expovariate(20.0) for _ in range(tokens)]
        rec = {"output_ids": ids, "text": tok.decode(ids), "finish_reason": {"type": "length", "length": tokens},
               "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)], "prompt_tokens": 16,
               "completion_tokens": tokens, "id": f"s{i}"}
        out.append(make_response(rec, True, "0", 1.0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    import orjson
    from starlette.responses import JSONResponse

    body = answer(args.samples, args.tokens)
    ways = {"json": (lambda: JSONResponse(body).body, json.loads), "orjson": (lambda: orjson.dumps(body), orjson.loads)}
    times: dict[str, dict[str, list[float]]] = {w: {"encode": [], "decode": []} for w in ways}
    size = 0
    for r in range(args.rounds):
        for w in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            enc, dec = ways[w]
            t0 = time.perf_counter()
            raw = enc()
            t1 = time.perf_counter()
            back = dec(raw)
            t2 = time.perf_counter()
            assert back == body, f"{w} does not round-trip the answer"
            times[w]["encode"].append(t1 - t0)
            times[w]["decode"].append(t2 - t1)
            size = len(raw)
    med = {w: {k: statistics.median(v) for k, v in t.items()} for w, t in times.items()}
    out = {"shape": {"samples": args.samples, "tokens": args.tokens, "bytes": size, "rounds": args.rounds},
           "seconds": med, "encode_ratio": med["json"]["encode"] / med["orjson"]["encode"],
           "decode_ratio": med["json"]["decode"] / med["orjson"]["decode"]}
    for w, m in med.items():
        print(f"{w:7} encode {m['encode']:6.3f} s  decode {m['decode']:6.3f} s  ({size / 1e6:.1f} MB)")
    print(f"response_codec: encode_ratio={out['encode_ratio']:.1f} decode_ratio={out['decode_ratio']:.1f} "
          f"({args.samples} samples x {args.tokens} tokens, median of {args.rounds} rounds each)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
