#!/usr/bin/env python3
"""Where one training step's GPU time goes: ampc's kernels (timed by Nsight Compute) beside
PyTorch's (torch.profiler), grouped by op family.

ampc side: the CSV that `ncu --csv --metrics gpu__time_duration.sum --clock-control none
--print-units base --profile-from-start off` writes for `AMPC_BENCH_CUDA_PROFILE_STEP=1 ampc-bench
--device cuda --warmup 5 --steps 1 ...`: the kernels of that one step (scripts/gpu/run.sh profile
makes it), summed per family. (A whole run's CSV does not do: its steps differ, the GradScaler
skipping the optimizer in the first ones.)
PyTorch side: the same workload as bench/pytorch_peer.py runs it (cudnn.benchmark on, autocast,
GradScaler for fp16, channels-last), warmed up, then `--torch-steps` steps under torch.profiler;
device time per kernel divided by the steps.

    python3 bench/profile_step.py --ncu-csv ampc_ncu.csv --workload resnet50 --mode amp-fp16 \\
        --batch 256 [--no-torch] [--json out.json]
"""
import argparse
import csv
import json
import re
import sys

FAMILIES = [
    # (family, regex on the kernel name), first match wins
    ("batch norm", r"batch_?norm|bn_fw|bn_bw|bn_|welford|reduce_vec|collapse_parts|reduce_cl|reduce_planar|BatchNorm"),
    ("pooling", r"pool"),
    ("conv + gemm", r"xmma|gemm|conv|cutlass|implicit|wgrad|dgrad|fprop|sm90_|sm80_|cudnn|Kernel2|nhwc|nchw|ampere|hopper"),
    ("loss + softmax", r"softmax|cross_entropy|ce_rows|ce_bwd|ce_finish|nll"),
    ("optimizer + scaler", r"sgd|adam|unscale|multi_tensor|foreach|(^|[^a-z])amp_|sumsq|non_finite|_amp_"),
    ("cast + copy", r"convert|permute|copy|fill|cast|transpose"),
    ("elementwise", r"."),
]


def family(name):
    for fam, rx in FAMILIES:
        if re.search(rx, name, re.I):
            return fam
    return "elementwise"


def read_ncu(path):
    """[(kernel name, ns)] in launch order."""
    rows = {}
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = r.get("Metric Unit", "ns")
        v = float(r["Metric Value"].replace(",", ""))
        scale = {"ns": 1, "nsecond": 1, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6, "s": 1e9, "second": 1e9}.get(unit, 1)
        rows[int(r["ID"])] = (r["Kernel Name"], v * scale)
    return [rows[k] for k in sorted(rows)]


def group(pairs):
    """{family: ms}, from [(name, ms)]"""
    out = {}
    for name, ms in pairs:
        f = family(name)
        out[f] = out.get(f, 0.0) + ms
    return out


def top_kernels(pairs, n=12):
    agg = {}
    for name, ms in pairs:
        agg[name] = agg.get(name, 0.0) + ms
    return sorted(agg.items(), key=lambda kv: -kv[1])[:n]


def torch_profile(workload, mode, batch, steps):
    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from pytorch_peer import cuda_step

    step, _ = cuda_step(workload, mode, workload != "mlp", batch)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    pairs = []
    for e in prof.events():
        dtype = str(getattr(e, "device_type", ""))
        if not dtype.endswith("CUDA"):
            continue
        us = getattr(e, "device_time", None)
        if us is None:
            us = getattr(e, "cuda_time", 0.0)
        if "Memcpy" in e.name or "Memset" in e.name:
            pairs.append(("memcpy/memset", us * 1e-3 / steps))
        else:
            pairs.append((e.name, us * 1e-3 / steps))
    return pairs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ncu-csv", help="ncu's CSV of one ampc-bench step (omit: PyTorch only)")
    ap.add_argument("--workload", default="resnet50")
    ap.add_argument("--mode", default="amp-fp16")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--torch-steps", type=int, default=3)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    res = {"workload": args.workload, "mode": args.mode, "batch": args.batch}
    cols = []
    if args.ncu_csv:
        step = read_ncu(args.ncu_csv)   # one step's kernels
        pairs = [(n, ns * 1e-6) for n, ns in step]
        res["ampc"] = {"kernels_per_step": len(step), "families_ms": group(pairs), "top": top_kernels(pairs)}
        cols.append(("ampc ms", res["ampc"]["families_ms"]))
    if not args.no_torch:
        pairs = torch_profile(args.workload, args.mode, args.batch, args.torch_steps)
        res["torch"] = {"families_ms": group(pairs), "top": top_kernels(pairs)}
        cols.append(("PyTorch ms", res["torch"]["families_ms"]))
    fams = [f for f, _ in FAMILIES] + ["memcpy/memset"]
    print(f"\nGPU time of one {args.workload} {args.mode} batch {args.batch} step by op family (kernel time, ms)")
    print(f"| family | " + " | ".join(c for c, _ in cols) + " |")
    print("| --- | " + " | ".join("---:" for _ in cols) + " |")
    for f in fams:
        if any(f in d for _, d in cols):
            print(f"| {f} | " + " | ".join(f"{d.get(f, 0.0):.2f}" for _, d in cols) + " |")
    print("| all kernels | " + " | ".join(f"{sum(d.values()):.2f}" for _, d in cols) + " |")
    for side in ("ampc", "torch"):
        if side in res:
            print(f"\n{side}: top kernels per step (ms)")
            for name, ms in res[side]["top"]:
                print(f"  {ms:8.3f}  {name[:150]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
