"""Small local lm-eval tasks from held-out Shakespeare (tests/data/heldout_excerpt.txt, never trained on),
one per request kind lm-eval sends: rolling perplexity, loglikelihood, multiple choice, generate_until.

    python scripts/clients/tasks.py OUT_DIR      # writes OUT_DIR/*.yaml and OUT_DIR/*.jsonl

Pass OUT_DIR to lm-eval with --include_path; the tasks are afd_ppl, afd_ll, afd_mc and afd_gen."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

EXCERPT = Path(__file__).resolve().parents[2] / "tests" / "data" / "heldout_excerpt.txt"
TASKS = ("afd_ppl", "afd_ll", "afd_mc", "afd_gen")


def speeches() -> list[list[str]]:
    """Blocks of verse (a speaker's lines), without the header, speaker names and stage directions."""
    text = EXCERPT.read_text().split("\n", 3)[3]
    out = []
    for block in text.split("\n\n"):
        lines = [x for x in block.splitlines() if x.strip() and not x.startswith("[")]
        if len(lines) > 1 and lines[0].rstrip().endswith("."):
            lines = lines[1:]  # the speaker's name, e.g. "King."
        if len(lines) >= 4:
            out.append(lines)
    return out


def write(out: Path, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    blocks = speeches()
    every_line = [line for b in blocks for line in b]
    windows = [(b[i - 3 : i], b[i]) for b in blocks for i in range(3, len(b))]
    rng.shuffle(windows)
    ppl = [{"text": "\n".join(b) + "\n"} for b in blocks[:10]]
    ll = [{"context": "\n".join(ctx) + "\n", "continuation": nxt} for ctx, nxt in windows[:20]]
    mc = []
    for ctx, nxt in windows[20:44]:
        choices = [nxt] + rng.sample([x for x in every_line if x != nxt], 3)
        rng.shuffle(choices)
        mc.append({"context": "\n".join(ctx) + "\n", "choices": choices, "label": choices.index(nxt)})
    gen = [{"context": "\n".join(ctx) + "\n", "continuation": nxt} for ctx, nxt in windows[44:56]]
    common = "dataset_path: json\ntest_split: test\n"
    specs = {
        "afd_ppl": (ppl, "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
                    "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"),
        "afd_ll": (ll, "output_type: loglikelihood\ndoc_to_text: '{{context}}'\ndoc_to_target: '{{continuation}}'\ntarget_delimiter: ''\n"
                   "metric_list:\n  - metric: perplexity\n  - metric: acc\n"),
        "afd_mc": (mc, "output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\n"
                   "doc_to_target: '{{label}}'\ntarget_delimiter: ''\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n"),
        "afd_gen": (gen, "output_type: generate_until\ndoc_to_text: '{{context}}'\ndoc_to_target: '{{continuation}}'\n"
                    "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 16\n  do_sample: false\n  temperature: 0.0\n"
                    "metric_list:\n  - metric: exact_match\n"),
    }
    for name, (docs, body) in specs.items():
        data = out / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (out / f"{name}.yaml").write_text(f"task: {name}\n{common}dataset_kwargs:\n  data_files:\n    test: {data}\n{body}")
    return list(TASKS)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(" ".join(write(Path(sys.argv[1]).resolve())))
