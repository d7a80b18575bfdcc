"""Could the first layers of the served model draft for it (LayerSkip-style self-speculation)?

    python scripts/early_exit_agreement.py [--model PATH.gguf] [--prompts 8] [--tokens 64]

Generates `--tokens` greedy tokens with `transformers` (float32) for `--prompts` ShareGPT first
turns (chat template, as `bench serve` samples them) and for one repetitive prompt ("Repeat
this paragraph 3 times"), then, over those tokens, applies the model's own final norm and LM
head to the hidden state after each layer E and prints, per E, the share of positions whose
top-1 token equals the full model's (the acceptance rate a greedy E-layer draft would see)
and E's cost as a share of a full decode step's weight bytes (E layers + the LM head over all
layers + the LM head). A draft pays only where acceptance is high at a small cost share.
"""

from __future__ import annotations

import argparse
import pathlib

import torch

from sluiceway.model_files import embedded_model_path
from sluiceway.sharegpt import sample_requests

PARAGRAPH = (
    "The quick brown fox jumps over the lazy dog near the river bank, while the farmer "
    "watches from his porch and sips his coffee slowly."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: the embedded one)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = embedded_model_path() if args.model is None else pathlib.Path(args.model)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    texts = [r.prompt for r in sample_requests(tok, args.prompts, seed=0, max_prompt_len=300)]
    texts.append("Repeat this paragraph 3 times: " + PARAGRAPH)
    layers = model.config.num_hidden_layers
    agree = {"sharegpt": [0] * (layers + 1), "repeat": [0] * (layers + 1)}
    counts = {"sharegpt": 0, "repeat": 0}
    with torch.inference_mode():
        for i, text in enumerate(texts):
            kind = "repeat" if i == len(texts) - 1 else "sharegpt"
            chat = [{"role": "user", "content": text}]
            prompt = list(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"])  # fmt: skip
            ids = torch.tensor([prompt])
            out = model.generate(ids, max_new_tokens=args.tokens, do_sample=False,
                                 min_new_tokens=args.tokens)  # fmt: skip
            full = model(out, output_hidden_states=True)
            rows = slice(len(prompt) - 1, out.shape[1] - 1)  # positions that predict output
            target = full.logits[0, rows].argmax(-1)
            for e in range(1, layers + 1):
                h = full.hidden_states[e][0, rows]  # the last entry is already normed
                h = h if e == layers else model.model.norm(h)
                agree[kind][e] += int((model.lm_head(h).argmax(-1) == target).sum())
            counts[kind] += out.shape[1] - len(prompt)
    per_layer = sum(p.numel() for p in model.model.layers[0].parameters() if p.dim() == 2)
    head = model.lm_head.weight.numel()
    print(f"# {path.name}: {layers} layers, {counts['sharegpt']} ShareGPT and "
          f"{counts['repeat']} repeat positions")  # fmt: skip
    print("exit_layer  cost_share  agree_sharegpt  agree_repeat")
    for e in range(1, layers + 1):
        cost = (e * per_layer + head) / (layers * per_layer + head)
        print(f"{e:10d}  {cost:10.2f}  {agree['sharegpt'][e] / counts['sharegpt']:14.3f}  "
              f"{agree['repeat'][e] / counts['repeat']:12.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
