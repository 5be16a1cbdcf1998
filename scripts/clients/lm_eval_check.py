"""lm-eval against ``afd serve`` equals lm-eval's own ``hf`` backend on the same checkpoint.

    python scripts/clients/lm_eval_check.py --lm-eval-python L/bin/python [--json OUT]

Runs the four local tasks of scripts/clients/tasks.py (rolling perplexity, loglikelihood, multiple
choice, generate_until) on the built-in model in fp32: once with ``--model hf`` (transformers, in
lm-eval's process: the reference), then with ``--model local-completions`` against ``afd serve``
monolithic and 2A1F async (batched token-id prompts), and ``local-chat-completions`` for
generate_until. Passes when perplexities agree within 1e-3 relative and accuracies within one item.
Too heavy for CI (an 800 MB venv with its own torch): run it after changing the serving path.
The venv is made by scripts/clients/setup-venvs.sh."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "clients"))

from tasks import write as write_tasks  # noqa: E402

from afd.cli.common import BUILTIN_MODEL  # noqa: E402
from afd.serving.spawn import ServerProcess  # noqa: E402
from rundir import in_run_dir  # noqa: E402

SERVERS = {
    "monolithic": [],
    "2A1F-async": ["--attention-ranks", "2", "--ffn-ranks", "1", "--transport", "shm", "--mode", "async"],
}
#: metric -> (tolerance kind, tolerance): perplexities relative, accuracies in items of the task
METRICS = {
    "afd_ppl": {"word_perplexity": ("rel", 1e-3), "byte_perplexity": ("rel", 1e-3), "bits_per_byte": ("rel", 1e-3)},
    "afd_ll": {"perplexity": ("rel", 1e-3), "acc": ("items", 1)},
    "afd_mc": {"acc": ("items", 1), "acc_norm": ("items", 1)},
    "afd_gen": {"exact_match": ("items", 1)},
}


def lm_eval(python: str, out: Path, model: str, model_args: str, tasks: Path, names: list[str], *extra: str) -> dict:
    """Run lm-eval once; its results per task, with each task's number of items."""
    cmd = [python, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", ",".join(names),
           "--include_path", str(tasks), "--output_path", str(out), "--batch_size", "8", "--log_samples", *extra]
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    if res.returncode:
        raise SystemExit(f"lm-eval failed ({res.returncode}):\n{res.stderr[-6000:]}")
    found = sorted(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    data = json.loads(found[-1].read_text())
    results = {t: {k.split(",")[0]: v for k, v in data["results"][t].items() if not k.startswith("alias")} for t in names}
    for t in names:
        results[t]["_items"] = data["n-samples"][t]["effective"]
        samples = sorted(out.rglob(f"samples_{t}_*.jsonl"), key=lambda p: p.stat().st_mtime)[-1]
        results[t]["_responses"] = {s["doc_id"]: s["resps"] for s in map(json.loads, samples.read_text().splitlines())}
    results["_seconds"] = time.perf_counter() - t0
    return results


def compare(ref: dict, got: dict, task: str) -> list[tuple[str, float, float, bool]]:
    rows = []
    for metric, (kind, tol) in METRICS[task].items():
        a, b = ref[task][metric], got[task][metric]
        ok = abs(a - b) <= tol * abs(a) if kind == "rel" else abs(a - b) <= tol / ref[task]["_items"] + 1e-12
        rows.append((metric, a, b, ok))
    if task == "afd_gen":  # the greedy generations themselves, item by item
        r, g = ref[task]["_responses"], got[task]["_responses"]
        same = sum(r[i] == g.get(i) for i in r)
        rows.append(("same generations", len(r), same, same >= len(r) - 1))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm-eval-python", required=True, help="python of the lm-eval venv (with torch and transformers)")
    ap.add_argument("--json", help="write every result here")
    args = ap.parse_args()
    return in_run_dir("afd-lm-eval-", lambda tmp: check(args, tmp))


def check(args: argparse.Namespace, tmp: Path) -> int:
    tasks = write_tasks(tmp / "tasks")
    model = BUILTIN_MODEL.name
    results = {"hf": lm_eval(args.lm_eval_python, tmp / "hf", "hf", f"pretrained={BUILTIN_MODEL},dtype=float32,max_length=1024,add_bos_token=True",
                             tmp / "tasks", tasks)}
    for name, flags in SERVERS.items():
        with ServerProcess(BUILTIN_MODEL, "--dtype", "float32", *flags, env={"AFD_NUM_THREADS": "1"}) as server:
            common = f"model={model},tokenizer={BUILTIN_MODEL},tokenizer_backend=huggingface,add_bos_token=True"
            results[name] = lm_eval(args.lm_eval_python, tmp / name, "local-completions",
                                    f"{common},base_url={server.url}/v1/completions,max_length=1024,num_concurrent=4", tmp / "tasks", tasks)
            if name == "monolithic":
                results["chat"] = lm_eval(args.lm_eval_python, tmp / "chat", "local-chat-completions",
                                          f"{common},base_url={server.url}/v1/chat/completions", tmp / "tasks", ["afd_gen"],
                                          "--apply_chat_template")
    failures = 0
    print(f"\n{'task':8} {'metric':16} {'hf':>14} " + " ".join(f"{n:>14}" for n in SERVERS) + "  agree")
    for task in tasks:
        rows = {n: compare(results["hf"], results[n], task) for n in SERVERS}
        for j, (metric, ref, _, _) in enumerate(rows["monolithic"]):
            oks = [rows[n][j][3] for n in SERVERS]
            failures += not all(oks)
            print(f"{task:8} {metric:16} {ref:14.6g} " + " ".join(f"{rows[n][j][2]:14.6g}" for n in SERVERS) + f"  {'yes' if all(oks) else 'NO'}")
    print(f"chat (local-chat-completions, generate_until): exact_match {results['chat']['afd_gen']['exact_match']:.3f} "
          f"over {results['chat']['afd_gen']['_items']} items (no hf reference: the model has no chat template)")
    print("seconds: " + ", ".join(f"{n} {r['_seconds']:.0f}" for n, r in results.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print("lm-eval check: " + ("PASS" if not failures else f"FAIL ({failures} metrics disagree)"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
