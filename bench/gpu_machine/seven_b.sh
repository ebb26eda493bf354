#!/usr/bin/env bash
# On the GPU machine (one H200): issue 54 point 6, the Qwen2.5-7B shape (random init, bf16, a synthetic 152,064-token
# tokenizer) through the real `train` flow, colocated with its embedded engine, ~1k-token responses:
# configs/gpu-7b.yaml (ZeRO-3, bf16, packed 8k-token rows, activation checkpointing, optimizer state to host memory
# at each hand-over, checkpoints off). bench/RESULTS.md 32 has what it measured.
#
#   bash bench/gpu_machine/seven_b.sh model                 # build the policy on the GPU into /tmp/models (torch and
#                                                           # transformers only: no carried wheels needed yet)
#   bash bench/gpu_machine/seven_b.sh install DIR           # install the wheels of carried folder DIR (once each; the
#                                                           # split ray wheel joins once both parts are in /tmp/gw)
#   bash bench/gpu_machine/seven_b.sh run [overrides...]    # the preflight with saving on (refused: the disk), then
#                                                           # the run; writes its log, memory samples and records
# The 15 GB policy cannot travel (64 MiB a call): it is made where it runs. Wheels: bench/gpu_machine/prepare.py
# (.gpuwheels/1..3) and a reflow wheel of this tree (`pip wheel --no-deps --no-build-isolation . -w DIR`), carried
# over consecutive calls of one warm machine (a carried folder may be gone in the next call: each is copied to /tmp).
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
out=$(realpath -m "${OUT:-gpu-out}"); mkdir -p "$out"
model=/tmp/models/qwen2.5-7b-random
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
case ${1:-run} in
model)
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; free -g; df -h /tmp; } \
    > "$out/machine.txt" 2>&1
  [ -e "$model/config.json" ] && exit 0
  python3 - "$model" <<'EOF' 2>&1 | tee "$out/model.log"
import sys, time
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

t0 = time.time()
# Qwen2.5-7B's config (hidden 3584, 28 layers, 28/4 heads, MLP 18944, untied 152,064-token embedding and head)
cfg = Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                  num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1e6,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):  # initialised on the GPU: seconds, where 7.6B parameters on the host take minutes
    model = Qwen2ForCausalLM(cfg)
torch.set_default_dtype(torch.float32)
params = sum(p.numel() for p in model.parameters())
built = time.time() - t0
model.save_pretrained(sys.argv[1], safe_serialization=True)
print(f"model: {params:,} parameters, built in {built:.1f} s, saved to {sys.argv[1]} in {time.time() - t0 - built:.1f} s")
EOF
  bash "$0" tokenizer
  du -sh "$model" | tee -a "$out/model.log"; df -h /tmp | tee -a "$out/model.log"
  ;;
tokenizer)
  # 152,064 synthetic tokens: the specials, the 256 byte-level symbols, then t0, t1, ... and no merges. transformers
  # 5.17's AutoTokenizer loads a model_type=qwen2 folder's tokenizer as a Qwen2Tokenizer (byte-level BPE) whatever
  # tokenizer_config.json names, so the byte symbols must be there: text becomes one token a character (a word-level
  # vocabulary alone encoded every prompt to no tokens at all).
  python3 - "$model" <<'EOF'
import sys
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
words = specials + alphabet
words += [f"t{i}" for i in range(152064 - len(words))]
tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(words)}, merges=[], unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                    unk_token="<unk>")
tokenizer.save_pretrained(sys.argv[1])
t = AutoTokenizer.from_pretrained(sys.argv[1])
ids = t(["a b c"])["input_ids"][0]
print(f"tokenizer: {type(t).__name__}, {len(t)} tokens; 'a b c' -> {ids}")
assert ids, "the tokenizer encodes nothing"
EOF
  ;;
install)
  mkdir -p /tmp/gw/new && cp "$2"/* /tmp/gw/new/
  for first in /tmp/gw/new/*.whl.part00 /tmp/gw/*.whl.part00; do  # a split wheel, once all its parts are here
    [ -e "$first" ] || continue
    whl=${first%.part00}; name=$(basename "$whl")
    mv /tmp/gw/new/"$name".part* /tmp/gw/ 2>/dev/null || true
    ls /tmp/gw/"$name".part01 > /dev/null 2>&1 || continue
    cat /tmp/gw/"$name".part* > /tmp/gw/new/"$name"
    python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).testzip()" /tmp/gw/new/"$name"
    rm /tmp/gw/"$name".part*
  done
  ls /tmp/gw/new/*.whl > /dev/null 2>&1 || exit 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    /tmp/gw/new/*.whl
  echo "installed $(ls /tmp/gw/new/*.whl | wc -l) wheels into /tmp/site"
  rm -rf /tmp/gw/new
  # bytecode once, not at every import of every process (bench/gpu_machine/install.sh says why)
  site=$(python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
  python3 -m compileall -q -j 0 /tmp/site "$site" > /dev/null || true
  ;;
run)
  shift
  export PYTHONPATH=/tmp/site:$repo/bench/gpu_machine PREFECT_HOME=/tmp/prefect-home RAY_USAGE_STATS_ENABLED=0
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the device notes
  [ -e "$PREFECT_HOME/prefect.db" ] || python3 -c "import asyncio; from prefect.server.database import \
provide_database_interface as db; asyncio.run(db().create_db())" > /dev/null 2>&1
  cfg=$repo/configs/gpu-7b.yaml
  stamp=$repo/bench/gpu_machine/stamp.py
  mkdir -p /tmp/gpurun && cd /tmp/gpurun  # outside the checkout, as run.sh
  # Prompts of 16 random letters (32 tokens: one a character) and a label nobody reads (the reward hashes the response)
  python3 -c "import json, random, string; r = random.Random(0); print('\n'.join(json.dumps({'prompt': ' '.join( \
r.choice(string.ascii_lowercase) for _ in range(16)), 'label': '0'}) for _ in range(2016)))" > /tmp/models/seven-b-prompts.jsonl
  # 1. Saving on (the last iteration's checkpoint, one kept): the preflight's disk check, verbatim.
  set +e
  python3 -m reflow.flows.cli config -c "$cfg" --check checkpoint.save_last=true checkpoint.keep_last=1 "$@" \
    > /dev/null 2> "$out/preflight-save-on.txt"
  echo "exit code $?" >> "$out/preflight-save-on.txt"
  set -e
  # 2. The run. GPU memory (nvidia-smi: every process on the card) and host memory (MemTotal - MemAvailable) every s.
  t0=$(date +%s.%N)
  (echo "s,gpu_mib,host_used_gib"
   while :; do
     gpu=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits)
     awk -v now="$(date +%s.%N)" -v t0="$t0" -v gpu="$gpu" '/MemTotal/{t=$2} /MemAvailable/{a=$2}
       END{printf "%.1f,%s,%.2f\n", now - t0, gpu, (t - a) / 1048576}' /proc/meminfo
     sleep 1
   done) > "$out/mem.csv" &
  sampler=$!
  set +e
  # a hung run still returns its log and samples: stopped after RUN_LIMIT_S (the device call's limit is 600 s)
  timeout -k 20 "${RUN_LIMIT_S:-480}" python3 -m reflow.flows.cli train -c "$cfg" -v --result-file "$out/result.json" \
    "$@" 2>&1 \
    | python3 -u "$stamp" "$t0" > "$out/train.log"
  code=${PIPESTATUS[0]}
  set -e
  kill "$sampler" || true
  echo "train exit code $code" | tee -a "$out/train.log"
  tail -n 25 "$out/train.log"
  run=$(ls -td .reflow/runs/*/ 2>/dev/null | head -1 || true); run=${run%/}
  [ -z "$run" ] || tar -czf "$out/records.tgz" --exclude='checkpoints' --exclude='*.parquet' -C "$(dirname "$run")" \
    "$(basename "$run")"
  exit "$code"
  ;;
*) echo "seven_b.sh: model, install DIR or run (got $1)" >&2; exit 2 ;;
esac
