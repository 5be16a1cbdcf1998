"""Offline generation, afd against vLLM's ``LLM`` on the same checkpoint, in one run:

    python scripts/clients/vllm_offline.py --vllm-python V/bin/python [--model DIR] [--batches 1,8] [--repeats 3] [--rounds 1]

Greedy, EOS ignored, random token-id prompts of ``--prompt-len`` tokens and ``--new-tokens`` new tokens,
fp32, one compute thread each. For every batch size: output tokens per second of the whole call (prefill
included), median of ``--repeats`` after a warm-up, for vLLM (``LLM.generate``, eager), afd's engine
(``LLMEngine.generate``) and afd's front end (what ``afd generate`` runs: ``run_offline`` over the engine).
The default model is the one ``vllm_bench.py --against-vllm`` writes (the built-in model's shape with
vLLM-CPU's MLA head size, random weights). ``--rounds R`` runs both sides R times in turn (vLLM, then afd) and
reports each round's ratios and their median: this machine drifts by tens of percent within minutes, for
both, so a ratio is only as good as the two sides being measured close together.
The vllm venv is made by scripts/clients/setup-venvs.sh."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VLLM_SIDE = r'''
import json, os, random, statistics, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
model, batches, prompt_len, new, repeats = sys.argv[1], [int(b) for b in sys.argv[2].split(",")], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=1024, seed=0)
params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
rng = random.Random(0)
out = {}
for b in batches:
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(10, 4000) for _ in range(prompt_len)]) for _ in range(b)]
    llm.generate(prompts, params, use_tqdm=False)
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=False)
        rates.append(sum(len(r.outputs[0].token_ids) for r in res) / (time.perf_counter() - t))
    out[b] = statistics.median(rates)
print("RESULT " + json.dumps(out), flush=True)
'''


def afd_side(model: str, batches: list[int], prompt_len: int, new: int, repeats: int) -> dict:
    import torch

    from afd.config import EngineArgs, SamplingParams
    from afd.engine.llm_engine import LLMEngine
    from afd.runtime.clients import LocalClient, engine_core_client
    from afd.serving.offline import run_offline

    torch.set_num_threads(1)
    engine = LLMEngine.from_pretrained(model, EngineArgs(dtype="float32"))
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    rng = random.Random(0)
    out: dict[str, dict[int, float]] = {"engine": {}, "front end": {}, "engine core": {}}
    core = engine_core_client(Path(model), EngineArgs(dtype="float32"), threads=1)
    for b in batches:
        prompts = [[rng.randrange(10, 4000) for _ in range(prompt_len)] for _ in range(b)]
        for name, run in (("engine", lambda: engine.generate(prompts, params)),
                          ("front end", lambda: run_offline(LocalClient(engine), engine.tokenizer, prompts, params)),
                          ("engine core", lambda: run_offline(core, engine.tokenizer, prompts, params, shutdown=False))):
            run()
            rates = []
            for _ in range(repeats):
                t = time.perf_counter()
                res = run()
                rates.append(sum(len(r.token_ids) for r in res) / (time.perf_counter() - t))
            out[name][b] = statistics.median(rates)
    core.close(10)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--model", help="checkpoint (default: the built-in model with vLLM-CPU's MLA head size, random weights)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="both sides this many times in turn; the median ratio is reported")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    from scripts.clients.rundir import in_run_dir

    return in_run_dir("afd-vllm-offline-", lambda tmp: run(args, tmp))


def run(args: argparse.Namespace, tmp: Path) -> int:
    if args.model is None:
        from scripts.clients.vllm_bench import vllm_compatible_model

        args.model = str(vllm_compatible_model(tmp / "builtin-mla576"))
    batches = [int(b) for b in args.batches.split(",")]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(tmp / "vllm-cache")}
    shim = ROOT.parent / "shared" / "tools" / "vllm_cli.py"
    code = VLLM_SIDE
    if shim.is_file():  # the vllm-cpu distribution's package metadata (see the shim)
        code = f"exec(compile(open({str(shim)!r}).read().split('if __name__')[0], 'shim', 'exec'))\n" + code
    rounds = []
    for r in range(args.rounds):
        print(f"round {r + 1} of {args.rounds}: vLLM, then afd", flush=True)
        res = subprocess.run([args.vllm_python, "-c", code, args.model, args.batches, str(args.prompt_len), str(args.new_tokens), str(args.repeats)],
                             capture_output=True, text=True, env=env, timeout=3600)
        line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
        if res.returncode or not line:
            raise SystemExit(f"the vLLM side failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
        vllm = {int(k): v for k, v in json.loads(line[0][7:]).items()}
        rounds.append({"vllm": vllm, "afd": afd_side(args.model, batches, args.prompt_len, args.new_tokens, args.repeats)})
    print(f"\noffline, greedy, prompt {args.prompt_len} + {args.new_tokens} new tokens, fp32, one thread; output tok/s (median of {args.repeats})")
    names = list(rounds[0]["afd"])
    print(f"{'batch':>5} {'round':>5} {'vLLM LLM':>9} " + " ".join(f"{'afd ' + n:>16} {'/ vLLM':>7}" for n in names))
    for b in batches:
        for r, got in enumerate(rounds):
            vllm, afd = got["vllm"], got["afd"]
            print(f"{b:5d} {r:5d} {vllm[b]:9.1f} " + " ".join(f"{afd[n][b]:16.1f} {afd[n][b] / vllm[b]:6.2f}x" for n in names))
    if args.rounds > 1:
        print("\nmedian over rounds of afd / vLLM:")
        for b in batches:
            print(f"batch {b:3d}: " + ", ".join(
                f"{n} {statistics.median(g['afd'][n][b] / g['vllm'][b] for g in rounds):.2f}x" for n in names))
    if args.json:
        Path(args.json).write_text(json.dumps(rounds, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
