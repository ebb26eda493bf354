#!/usr/bin/env bash
# On the GPU machine, in the repo root, once .gpuwheels/sglang/1..N have all arrived (sglang_carry.md):
#   bash bench/gpu_machine/sglang_start.sh
# 1. joins and installs the carried wheels into /tmp/sglang-site (install.sh; --no-deps);
# 2. imports, one by one in a child interpreter, the modules the server needs (each failure printed verbatim);
# 3. writes a tiny HF Llama (2 layers, reflow's demo character tokenizer, bf16) into /tmp/sglang-tiny;
# 4. starts `python3 -m sglang.launch_server` on 127.0.0.1 with an API key handed over as reflow's launcher does
#    (a 0600 --config file), --mem-fraction-static 0.3, --grammar-backend none, --enable-memory-saver, and
#    waits for /health_generate (if it dies with the memory saver on, it tries once more without it);
# 5. sends one /generate and prints the answer, then the control calls reflow makes (get_weights_by_name,
#    flush_cache, pause/continue, abort_request, release/resume_memory_occupation, update_weights_from_disk,
#    begin/end_weight_update if the server has them), each status and body, and a /generate after them.
# Everything goes to $OUT (7 files): steps.log (this script's own log, the FAILED line verbatim), install.log,
# preflight.log, server.log (the server's output), calls.jsonl (each HTTP call and answer), env.txt, summary.txt.
# Knobs: SGLANG_EXTRA_FLAGS (more launch flags, e.g. "--disable-cuda-graph" or "--attention-backend triton"),
# SGLANG_MEMSAVER=0 (start without --enable-memory-saver), SGLANG_TIMEOUT (seconds for /health_generate, 300),
# SGLANG_SKIP_INSTALL=1 (the site is there already: a second call on a warm machine).
set -uo pipefail
OUT=${OUT:-/tmp/sglang-out}; mkdir -p "$OUT"
REPO=$(pwd); SITE=/tmp/sglang-site; MODEL=/tmp/sglang-tiny; PORT=${SGLANG_PORT:-30123}
STUBS=$REPO/bench/gpu_machine/sglang_stubs
LOG=$OUT/steps.log; : > "$LOG"
say() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$LOG"; }
fail() { say "FAILED at step: $1"; [ -n "${2:-}" ] && { echo "----- verbatim -----"; cat "$2"; echo "--------------------"; } | tee -a "$LOG"
         summary "FAILED: $1"; exit 1; }
summary() { { echo "$1"; echo "wall seconds: $SECONDS"; } > "$OUT/summary.txt"; }

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; python3 --version; ldd --version | head -1
  python3 -m pip list 2>/dev/null | grep -i -E "^(torch|transformers|triton|cuda-bindings|nvidia-ml-py|torchvision) "; } > "$OUT/env.txt" 2>&1
say "env: $(tr '\n' ';' < "$OUT/env.txt")"

# 1. install
if [ "${SGLANG_SKIP_INSTALL:-0}" != 1 ]; then
  say "install: $(find .gpuwheels/sglang -type f | wc -l) files under .gpuwheels/sglang -> $SITE"
  if ! bash bench/gpu_machine/install.sh .gpuwheels/sglang "$SITE" > "$OUT/install.log" 2>&1; then
    # the likeliest refusal: sglang's own wheel is manylinux_2_34 (glibc >= 2.34). Its three Rust _core modules are
    # optional on this path, so unpack it by hand and install the rest.
    say "install.sh failed (see install.log); retrying with sglang's wheel unpacked and the rest installed"
    grep -v "^$" "$OUT/install.log" | tail -5 | tee -a "$LOG"
    whls=$(ls .gpuwheels/sglang/*.whl | grep -v '/sglang-0')
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" $whls >> "$OUT/install.log" 2>&1 \
      || fail "pip install --target $SITE (without sglang's wheel)" "$OUT/install.log"
    python3 -m zipfile -e .gpuwheels/sglang/sglang-0*.whl "$SITE" >> "$OUT/install.log" 2>&1 \
      || fail "unpacking sglang's wheel" "$OUT/install.log"
  fi
  say "install: $(tail -2 "$OUT/install.log" | tr '\n' ' ')"
fi
# fastapi, uvicorn, pydantic, orjson come from reflow's own set (.gpuwheels/1-3, installed into /tmp/site by
# bench/gpu_machine/install.sh in an earlier call, BEFORE the sglang folders arrive: install.sh gathers every wheel
# below the folder it is given)
[ -e /tmp/site/fastapi ] || fail "reflow's wheels (.gpuwheels/1-3) are not installed in /tmp/site: carry and install them first"
# reflow's site without `kernels`: its 0.19 API breaks transformers 5.12.1's hub_kernels at import ("Either a
# revision or a version must be specified", seen on the H100); without it transformers skips hub kernels
mkdir -p /tmp/site-sg && for f in /tmp/site/*; do case $(basename "$f") in kernels|kernels-*) ;; *) ln -sfn "$f" /tmp/site-sg/ ;; esac; done
export PYTHONPATH=$SITE:/tmp/site-sg:$REPO/src:$STUBS  # stand-ins last: a real package wins
say "PYTHONPATH=$PYTHONPATH"

# 2. preflight imports: each in the same child, a failure printed with its traceback, then go on
python3 - > "$OUT/preflight.log" 2>&1 <<'EOF'
import importlib, time, traceback, sys
mods = ["torch", "sgl_kernel", "tvm_ffi", "flashinfer", "flashinfer.sampling", "torch_memory_saver", "zmq",
        "sglang", "sglang.srt.server_args", "sglang.srt.entrypoints.http_server", "sglang.srt.entrypoints.engine",
        "sglang.srt.managers.tokenizer_manager", "sglang.srt.managers.scheduler",
        "sglang.srt.managers.detokenizer_manager", "sglang.srt.model_executor.model_runner",
        "sglang.srt.layers.attention.flashattention_backend", "sglang.srt.layers.attention.flashinfer_backend",
        "sglang.srt.layers.attention.triton_backend", "sglang.srt.layers.sampler", "sglang.srt.models.llama",
        "sglang.srt.models.qwen2"]
bad = 0
for m in mods:
    t = time.time()
    try:
        mod = importlib.import_module(m)
        print(f"ok   {m} ({time.time() - t:.1f} s) {getattr(mod, '__version__', '')} {getattr(mod, '__file__', '')}")
    except BaseException:
        bad += 1
        print(f"FAIL {m}:")
        traceback.print_exc(file=sys.stdout)
import torch, transformers
print("torch", torch.__version__, torch.version.cuda, "cuda available:", torch.cuda.is_available(),
      "transformers", transformers.__version__)
stubs = [m for m in ("IPython", "xgrammar") if m in sys.modules]
print("stand-ins imported:", [f"{m} ({sys.modules[m].__file__})" for m in stubs])
sys.exit(1 if bad else 0)
EOF
pre=$?
grep -E "^(ok|FAIL)|stand-ins|^torch" "$OUT/preflight.log" | tee -a "$LOG"
[ $pre -eq 0 ] || say "preflight: some imports failed (first traceback below); starting the server anyway"
[ $pre -eq 0 ] || awk '/^FAIL/{p=1} p' "$OUT/preflight.log" | head -40 | tee -a "$LOG"

# 3. the tiny model
python3 - "$MODEL" >> "$LOG" 2>&1 <<'EOF' || fail "writing the tiny model" "$LOG"
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from reflow.rl.demo_policy import build_tokenizer
tok = build_tokenizer()
cfg = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                  pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  tie_word_embeddings=False)
torch.manual_seed(0)
LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1])
tok.save_pretrained(sys.argv[1])
print("tiny model:", sys.argv[1], "vocab", len(tok), "eos", tok.eos_token_id, "prompt ids", tok("12+34=")["input_ids"])
EOF
say "model written: $(ls $MODEL | tr '\n' ' ')"

# 4. the server
KEY=$(python3 -c "import secrets; print(secrets.token_hex(16))")
SECRETS=$(mktemp -d); printf '{"api-key": "%s"}\n' "$KEY" > "$SECRETS/server-config.yaml"; chmod 600 "$SECRETS/server-config.yaml"
start_server() {  # $1: extra flags
  CMD=(python3 -m sglang.launch_server --config "$SECRETS/server-config.yaml" --model-path "$MODEL" --tokenizer-path "$MODEL"
       --host 127.0.0.1 --port "$PORT" --mem-fraction-static 0.3 --grammar-backend none --dtype bfloat16
       --random-seed 0 --log-level info $1 ${SGLANG_EXTRA_FLAGS:-})
  say "launch: ${CMD[*]}"
  "${CMD[@]}" >> "$OUT/server.log" 2>&1 &
  SPID=$!
  local t0=$SECONDS code
  while [ $((SECONDS - t0)) -lt "${SGLANG_TIMEOUT:-300}" ]; do
    kill -0 $SPID 2>/dev/null || { wait $SPID; code=$?; say "server exited with code $code after $((SECONDS - t0)) s"; return 1; }
    code=$(curl -s -o /dev/null -w '%{http_code}' -m 30 -H "Authorization: Bearer $KEY" "http://127.0.0.1:$PORT/health_generate")
    [ "$code" = 200 ] && { say "healthy after $((SECONDS - t0)) s"; return 0; }
    sleep 2
  done
  say "not healthy after ${SGLANG_TIMEOUT:-300} s (last /health_generate: $code)"; return 1
}
stop_server() { kill -- -$SPID 2>/dev/null; sleep 5; kill -9 -- -$SPID 2>/dev/null; }  # its process group (set -m)
server_error() {  # the server's first traceback / error lines, verbatim
  { echo "(server.log: first Traceback and the last 25 lines)"; awk '/Traceback/{p=1} p' "$OUT/server.log" | head -60
    echo "..."; tail -25 "$OUT/server.log"; } > /tmp/sglang-server-error.txt; echo /tmp/sglang-server-error.txt; }
set -m  # the server in its own process group, so stop_server ends its scheduler/detokenizer children
MEMSAVER=""; [ "${SGLANG_MEMSAVER:-1}" = 1 ] && MEMSAVER="--enable-memory-saver"
echo "=== launch 1 ($MEMSAVER) ===" >> "$OUT/server.log"
if ! start_server "$MEMSAVER"; then
  err=$(server_error); stop_server
  if [ -n "$MEMSAVER" ]; then
    say "start with --enable-memory-saver failed (verbatim):"; head -80 "$err" | tee -a "$LOG"
    MEMSAVER=""
    echo "=== launch 2 (no memory saver) ===" >> "$OUT/server.log"
    start_server "" || { err=$(server_error); stop_server; fail "sglang.launch_server (without the memory saver too)" "$err"; }
  else
    fail "sglang.launch_server" "$err"
  fi
fi
rm -rf "$SECRETS"

# 5. calls
python3 - "$PORT" "$KEY" "$MODEL" "$MEMSAVER" > "$OUT/calls.jsonl" 2>> "$LOG" <<'EOF'
import json, sys, time, urllib.request, urllib.error
port, key, model, memsaver = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
def call(method, path, body=None, timeout=120):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    t = time.time()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode(errors="replace")
    except Exception as e:
        status, text = -1, repr(e)
    row = {"call": f"{method} {path}", "body": body, "status": status, "seconds": round(time.time() - t, 3),
           "answer": text[:2000]}
    print(json.dumps(row), flush=True)
    print(f"{method} {path} -> {status} ({row['seconds']} s): {text[:300]}", file=sys.stderr, flush=True)
    return status, text
from reflow.rl.demo_policy import build_tokenizer
ids = build_tokenizer()("12+34=")["input_ids"]
gen = {"input_ids": [ids, ids], "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 1},
       "return_logprob": True}
call("POST", "/generate", gen)
call("GET", "/server_info"); call("GET", "/model_info")
call("POST", "/get_weights_by_name", {"name": "model.layers.0.self_attn.q_proj.weight", "truncate_size": 2})
call("POST", "/flush_cache", {})
call("POST", "/pause_generation", {"mode": "abort"}); call("POST", "/continue_generation", {})
call("POST", "/abort_request", {"abort_all": True})
s, _ = call("POST", "/begin_weight_update", {"selector": "all"})  # 0.5.2x sessions; 404 expected on 0.5.17
if s == 200:
    call("POST", "/end_weight_update", {})
call("POST", "/update_weights_from_disk", {"model_path": model, "weight_version": "disk-1"})
if memsaver:
    call("POST", "/release_memory_occupation", {"tags": None})
    call("POST", "/resume_memory_occupation", {"tags": None})
call("POST", "/generate", gen)
EOF
say "calls: $(wc -l < "$OUT/calls.jsonl") answered (calls.jsonl)"
first=$(head -1 "$OUT/calls.jsonl")
say "first /generate: ${first:0:1500}"
stop_server
if echo "$first" | grep -q '"status": 200'; then
  summary "OK: sglang.launch_server generated (memory saver: ${MEMSAVER:-off}); calls in calls.jsonl"
else
  fail "POST /generate" "$OUT/calls.jsonl"
fi
say "done in $SECONDS s"
