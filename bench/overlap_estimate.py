"""What DDP's overlap of all-reduce with backward would save on a GPU cluster: an estimate.

    PYTHONPATH=. python bench/overlap_estimate.py [--world 8] [--batch 16]

No GPU here, so the gain is estimated, from two measured inputs and a stated network model:

1. **When each gradient is ready**, measured: the model of the H100 step-time curves in
   ``../shared/data/h100_tb_curves.csv`` (``gpt6L-768d-seq512``: 6 transformer layers, width 768,
   GPT-2's 50,257-token vocabulary, tied embeddings, about 81M parameters) runs one backward on
   this CPU, and a post-accumulate hook on every parameter records when its gradient is ready,
   as a fraction of the backward. The parameters are then put in buckets as DDP does (reverse
   order of registration; the first bucket 1 MiB, the others ``bucket_cap_mb`` = 25 MiB); a
   bucket is ready when its last gradient is.
2. **How long backward takes on an H100**: two thirds of the measured step time at the given
   batch (bf16), the usual split of a step between forward (1/3) and backward (2/3). The ready
   fractions of step 1 are applied to it: this assumes the layers' shares of backward are the
   same on a GPU as on this CPU, which holds roughly for a transformer (its time is in
   matrix multiplies of the same shapes), less for the embedding's sparse-ish gradient.
3. **The network**: a ring all-reduce of ``n`` bytes over ``k`` ranks takes
   ``2(k-1)/k * n / bandwidth + 2(k-1) * latency`` (bandwidth-optimal ring, per-step latency
   ``--latency-us``), for Ethernet links of 25, 100 and 400 Gb/s (mixed-generation clusters are
   usually joined by Ethernet).

Without overlap (the coalesced synchroniser on a GPU): step = forward + backward + one
all-reduce of every gradient. With it: bucket ``i``'s all-reduce starts when it is ready and the
previous one has finished; step = forward + the end of the last all-reduce (at least backward).
The gain is the fraction of the step saved. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

CURVES = Path(__file__).resolve().parents[2] / "shared" / "data" / "h100_tb_curves.csv"
FIRST_BUCKET, BUCKET = 1 << 20, 25 << 20
"""DDP's bucket sizes: the first (last parameters) 1 MiB, the others 25 MiB (bucket_cap_mb)."""


class GPT(nn.Module):
    """The ``gpt6L-768d-seq512`` shape: token and position embeddings, 6 pre-norm layers, a
    tied head."""

    def __init__(self, vocab: int = 50257, width: int = 768, layers: int = 6, seq: int = 512):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(seq, width)
        layer = nn.TransformerEncoderLayer(width, 12, 4 * width, batch_first=True, norm_first=True)
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        h = self.tokens(ids) + self.positions(torch.arange(n))
        causal = torch.ones(n, n, dtype=torch.bool).triu(1)
        out: torch.Tensor = self.norm(self.layers(h, mask=causal, is_causal=True))
        return out @ self.tokens.weight.T


def ready_fractions(batch: int, seq: int) -> tuple[list[tuple[float, int]], float]:
    """(ready fraction of backward, bytes) per DDP bucket, in the order DDP reduces them; and
    the measured backward time on this CPU (ms)."""
    torch.manual_seed(0)
    model = GPT()
    params = [p for p in model.parameters() if p.requires_grad]
    ready: dict[int, float] = {}
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
            lambda _p, i=i: ready.__setitem__(i, time.perf_counter())
        )
    ids = torch.randint(0, 50257, (batch, seq))
    loss = nn.functional.cross_entropy(model(ids[:, :-1]).transpose(1, 2), ids[:, 1:])
    t0 = time.perf_counter()
    loss.backward()  # type: ignore[no-untyped-call]
    total = time.perf_counter() - t0
    buckets: list[tuple[float, int]] = []
    cap, size, last = FIRST_BUCKET, 0, 0.0
    for i in reversed(range(len(params))):  # DDP's order: last registered first
        size += params[i].numel() * 4
        last = max(last, ready[i] - t0)
        if size >= cap:
            buckets.append((last / total, size))
            cap, size, last = BUCKET, 0, 0.0
    if size:
        buckets.append((last / total, size))
    return buckets, total * 1000


def h100_step_ms(batch: int) -> float:
    with CURVES.open() as f:
        for row in csv.DictReader(f):
            if (row["model"], row["precision"], row["batch"]) == (
                "gpt6L-768d-seq512",
                "bf16",
                str(batch),
            ):
                return float(row["median_ms"])
    raise SystemExit(f"no H100 step time for batch {batch} in {CURVES}")


def estimate(
    buckets: list[tuple[float, int]], step_ms: float, world: int, gbps: float, latency_us: float
) -> dict[str, float]:
    forward, backward = step_ms / 3, 2 * step_ms / 3
    per_byte_ms = 2 * (world - 1) / world * 8 / (gbps * 1e9) * 1000
    steps_ms = 2 * (world - 1) * latency_us / 1000

    def reduce_ms(n: int) -> float:
        return n * per_byte_ms + steps_ms

    whole = sum(n for _, n in buckets)
    without = forward + backward + reduce_ms(whole)
    end = 0.0
    for fraction, n in buckets:  # in order: each waits for its gradients and the one before
        end = max(end, fraction * backward) + reduce_ms(n)
    with_overlap = forward + max(backward, end)
    return {
        "step_ms_without_overlap": round(without, 2),
        "step_ms_with_overlap": round(with_overlap, 2),
        "sync_share_without": round(reduce_ms(whole) / without, 3),
        "gain": round(1 - with_overlap / without, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16, help="per GPU, as in the H100 curve")
    parser.add_argument("--cpu-batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128, help="of the CPU backward measured")
    parser.add_argument("--latency-us", type=float, default=10.0)
    args = parser.parse_args()
    torch.set_num_threads(2)
    buckets, cpu_ms = ready_fractions(args.cpu_batch, args.seq)
    step = h100_step_ms(args.batch)
    report: dict[str, Any] = {
        "model": "gpt6L-768d-seq512 (bf16 H100 step time)",
        "parameters": sum(p.numel() for p in GPT().parameters()),
        "world": args.world,
        "h100_step_ms": step,
        "cpu_backward_ms": round(cpu_ms, 1),
        "buckets": [{"ready": round(f, 3), "mib": round(n / 2**20, 1)} for f, n in buckets],
        "ethernet": {
            f"{g}gbps": estimate(buckets, step, args.world, g, args.latency_us)
            for g in (25, 100, 400)
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
