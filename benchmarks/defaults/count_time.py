"""How long the default cut's count takes before the first step, by depth: a transformers Llama's decoder units
(``from_hf``'s: the embedding with the first, the head with the last) counted on the meta device, with a repeated
layer matched (the default) and with every layer run (what the count did before 2026-12-06).

    python -m benchmarks.defaults.count_time --layers 4 8 16 32 --repeats 3

Prints the median seconds of each and their ratio per depth; nothing is trained. Needs ``stagewise[hf]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def llama(layers: int) -> torch.nn.Module:
    """A small float32 Llama (d 128, 4 heads, vocabulary 512): its count's time is Python's, not the size's."""
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return tf.LlamaForCausalLM(config)


def timed(count: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        count()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=3, help="counts per depth and way (the median is shown)")
    parser.add_argument("--sequence", type=int, default=64, help="tokens per sample (2 samples: one micro-batch)")
    args = parser.parse_args(argv)

    # the units from_hf cuts a model into, and the count itself with its key to switch off: no public names
    from stagewise.runtime.frontends.hf import FromHF
    from stagewise.runtime.measure import counting

    torch.set_num_threads(1)
    ids = torch.randint(0, 512, (2, args.sequence))
    print("| decoder layers | repeats matched (s) | every layer run (s) | ratio |")
    print("|---:|---:|---:|---:|")
    for layers in args.layers:
        model = llama(layers)
        units = [u for _, u in FromHF(model, check=False).units()]
        names = [str(k) for k in range(len(units))]

        def count(names: list[str] = names, units: list[Any] = units) -> Any:
            return counting.count_layers(names, units.__getitem__, ids)

        matched = timed(count, args.repeats)
        key = counting._work_key
        counting._work_key = lambda module, inputs: None  # type: ignore[assignment]
        try:
            every = timed(count, args.repeats)
        finally:
            counting._work_key = key
        print(f"| {layers} | {matched:.2f} | {every:.2f} | {every / matched:.1f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
