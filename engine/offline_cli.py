"""`splitserve offline`: generate with the in-process engine; prints text and timing to stdout."""

from __future__ import annotations

import argparse
import time

from engine.model_dir import MODEL_HELP


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="*", help="prompt text(s); default: the demo chat request")
    parser.add_argument("--model", default="tiny", help=MODEL_HELP)
    parser.add_argument("--system", default="You answer questions about Acme products.")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)


def run(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams
    from engine.model_dir import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    llm = LLM(model_dir)
    if args.prompt:
        prompts = list(args.prompt)
    else:
        messages = [
            {"role": "system", "content": args.system},
            {"role": "user", "content": "Why is my device blinking amber?"},
        ]
        prompts = [llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for out in outputs:
        print(f"--- prompt ({len(out.prompt_token_ids)} tokens)\n{out.prompt}")
        print(f"--- output ({len(out.token_ids)} tokens, finish={out.finish_reason})\n{out.text}")
    n = sum(len(o.token_ids) for o in outputs)
    print(f"--- {n} tokens in {elapsed:.2f}s ({n / elapsed:.1f} tok/s); model: {model_dir}")
    if str(args.model).startswith("tiny"):
        print("note: the built-in tiny model has random weights, so its text is gibberish by design.")
    return 0
