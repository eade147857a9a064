"""Host Adam kernels side by side: DeepSpeed's CPU Adam op against torch's fused AdamW, same buffers.

The engine's host side uses whichever is faster here; run this on a new machine to re-check:
    python bench/kernels.py --numel 16000000 --repeats 10
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lightning_dos.engine.kernels import AdamHyper, adam_update


def _time(fn, repeats: int) -> float:  # noqa: ANN001
    fn()  # warm up (and, for DeepSpeed, trigger the JIT build outside the timing)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--numel", type=int, default=16_000_000)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    n = args.numel
    p, g, m, v = (torch.randn(n) for _ in range(4))
    v.abs_()
    step = torch.tensor(1.0)

    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True)

    def fused() -> None:  # the engine's own kernel call
        adam_update(p, g, m, v, step, hyper)

    rows = [("torch._fused_adamw_", _time(fused, args.repeats))]
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam([torch.nn.Parameter(p)], lr=1e-3, weight_decay=0.1)
        op = opt.ds_opt_adam

        def deepspeed_op() -> None:
            op.adam_update(opt.opt_id, 1, 1e-3, 0.9, 0.999, 1e-8, 0.1, True, p, g, m, v)

        rows.append(("DeepSpeedCPUAdam adam_update", _time(deepspeed_op, args.repeats)))
    except Exception as error:  # noqa: BLE001 - report why the op could not run, keep the other row
        print(f"DeepSpeed CPU Adam unavailable: {error}")
    base = rows[0][1]
    print(f"| kernel | {n / 1e6:.0f}M elements, s (median of {args.repeats}) | G elements/s | time vs fused |")
    print("|---|---|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.4f} | {n / seconds / 1e9:.2f} | {seconds / base:.2f}x |")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
