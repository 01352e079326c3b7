"""`tide-hf demo`: calibrate the embedded SmolLM2 on SOTU, print the routers' metrics, generate with TIDE."""

from __future__ import annotations

import argparse

from ..calibration.command import calibrate_from_args, print_metrics
from ..calibration.distributed import is_main_process
from ..runtime import attach


def run(args: argparse.Namespace) -> None:
    """Calibrate, save, show metrics, and generate one answer with TIDE attached."""
    model, tokenizer, router = calibrate_from_args(args)
    if not is_main_process():  # under `accelerate launch` the main process saves and generates
        return
    router.save_pretrained(args.output, overwrite=True)  # the demo's own folder; never a model's
    print_metrics(router)
    print(f"router saved to {args.output}")
    handle = attach(model, router)
    messages = [{"role": "user", "content": args.prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
    print("\nTIDE generation:", tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    print(handle.last_stats.summary())
    if args.stats_png:
        print("exit histogram:", handle.last_stats.plot(args.stats_png))
