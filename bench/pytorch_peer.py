#!/usr/bin/python3
"""pytorch_peer.py - the ampc-bench workloads in PyTorch, and the side-by-side comparison.

Runs with Debian's PyTorch (python3-torch 1.13, /usr/bin/python3; the pyenv python3 on PATH
cannot see it). Never needed by the build or the tests.

    /usr/bin/python3 bench/pytorch_peer.py                      PyTorch only, JSON on stdout
    /usr/bin/python3 bench/pytorch_peer.py --compare --ampc-bench build/ampc-bench
                                                                ampc and PyTorch, one table
    options: --workloads mlp,cnn,resnet18[,resnet50] --modes fp32,amp-bf16[,amp-fp16]
             --steps N --warmup N --threads N --repeat R --json FILE
             --channels-last yes|no (PyTorch's conv nets; default no, PyTorch's default)
             --ampc-channels-last yes|no (ampc-bench's --channels-last; default yes, its default)

The same workloads as ampc-bench (tools/ampc-bench.c), same shapes, same step: forward under
torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp), F.cross_entropy, backward,
SGD(lr 0.01, momentum 0.9).step(), zero_grad(set_to_none=True) (ampc's zero_grad sets
gradients to none, as PyTorch 2 does by default). No GradScaler: bf16 runs without one (as
in ampc-bench), and PyTorch 1.13's CPU autocast has no fp16 (amp-fp16 is ampc-only).

  mlp       Flatten, Linear(784, 2048), ReLU, Linear(2048, 2048), ReLU, Linear(2048, 10); batch 256
  cnn       PyTorch's examples/mnist Net returning logits (ampc's zoo "cnn"); batch 128, 1x28x28
  resnet18  torchvision resnet18(num_classes=10) with conv1 = 3x3 stride 1 pad 1 (no bias) and
            maxpool = Identity (ampc's small_input); batch 64, 3x32x32
  resnet50  torchvision resnet50() (1000 classes); batch 16, 3x224x224
  gpt       nanoGPT's GPT (tests/fixtures/nanogpt.py) 6 layers, 6 heads, 384 wide, block 256,
            vocabulary 65 (shakespeare_char); batch 16; random tokens; AdamW(6e-4, betas 0.9/0.95,
            weight decay 0.1 on the Linear weights) instead of SGD, as ampc-bench
  gpt2      the same GPT at GPT-2 124M's size (12 x 768, block 1024, vocabulary 50257); batch 1

BLAS: PyTorch runs fp32 Linear layers on the system BLAS, which on Debian 12 defaults to the
netlib reference implementation (BLAS_INFO=generic; 1.5 s for the fp32 mlp step instead of
~40 ms). --blas openblas (the default) runs each PyTorch process on Debian's OpenBLAS
(libopenblas0-pthread) through LD_LIBRARY_PATH instead, without touching the system's
alternatives: the system copy if installed, else one fetched with `apt-get download` and
unpacked under --openblas-dir (build/peer-openblas). OpenBLAS 0.3.21 does not know Zen 5 and
would pick its AVX2 kernels; OPENBLAS_CORETYPE=SkylakeX selects its AVX-512 ones (1.6x
faster here). --blas system measures PyTorch as installed. Convolutions and every bf16
matmul run on PyTorch's bundled oneDNN (2.6.3, the version ampc uses) either way.

Tuning (--tuning guide, the default): PyTorch as its CPU performance tuning guide sets it up
(pytorch.org/tutorials/recipes/recipes/tuning_guide.html, and Intel's guide for PyTorch): an
allocator that keeps freed memory instead of unmapping it (glibc's default unmaps every large
tensor, and the page faults dominate a small model's step: mlp bf16 120-136 ms instead of 18.7
ms); OMP_NUM_THREADS, OMP_SCHEDULE=STATIC, OMP_PROC_BIND=CLOSE and GOMP_CPU_AFFINITY binding one
thread per core (PyTorch links GNU OpenMP); channels_last for the conv nets (--channels-last
auto). The guide offers two allocator setups, and neither wins everywhere, so --allocator best
(the default) times both in every repeat and keeps, per config, the faster one's median (the
table names it): Debian's jemalloc preloaded (libjemalloc2; fetched with `apt-get download` into
--jemalloc-dir when not installed) with the guide's MALLOC_CONF, and glibc's malloc with
MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ at 4 GiB. On an AMD Zen 4 (2026-11-28) glibc's
was 1.2-1.6x faster on every workload (resnet18 bf16: 552 against 726 ms), so a jemalloc-only
peer was a handicapped one. --allocator jemalloc|glibc times one. --tuning none runs PyTorch as
installed (glibc malloc, no binding, NCHW). --compare runs both and prints the untuned figure as
another column.

Each config runs in a fresh process (this script with --one), so that its resident-set growth
is its own: VmHWM after the warm-up and timed steps minus VmRSS before the first step
(/proc/self/clear_refs resets the high-water mark), i.e. activations, gradients, optimizer
state and workspace, plus one-time costs such as JIT-compiled kernels. ampc-bench also runs
one config per process in --compare mode, for the same reason.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

WORKLOADS = {
    # name: (batch, input shape per sample, classes)
    "mlp": (256, (784,), 10),
    "cnn": (128, (1, 28, 28), 10),
    "resnet18": (64, (3, 32, 32), 10),
    "resnet50": (16, (3, 224, 224), 1000),
    # language models (tests/fixtures/nanogpt.py): input (batch, block) tokens, classes the vocabulary
    "gpt": (16, (256,), 65),
    "gpt2": (1, (1024,), 50257),
}
GPT_CONFIGS = {   # ampc-bench's: nanoGPT's shakespeare_char and GPT-2 124M
    "gpt": dict(block_size=256, vocab_size=65, n_layer=6, n_head=6, n_embd=384, bias=True),
    "gpt2": dict(block_size=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768, bias=True),
}
TORCH_MODES = ("fp32", "amp-bf16")
ALL_MODES = ("fp32", "amp-bf16", "amp-fp16")


# ---------------------------------------------------------------------------------------------
# One config, in this process


def build(name):
    import torch.nn as nn
    import torch.nn.functional as F

    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                             nn.Linear(2048, 10))
    if name == "cnn":
        class Net(nn.Module):   # examples/mnist, logits out (cross_entropy applies log_softmax)
            def __init__(self):
                super().__init__()
                self.conv1 = nn.Conv2d(1, 32, 3, 1)
                self.conv2 = nn.Conv2d(32, 64, 3, 1)
                self.dropout1 = nn.Dropout(0.25)
                self.dropout2 = nn.Dropout(0.5)
                self.fc1 = nn.Linear(9216, 128)
                self.fc2 = nn.Linear(128, 10)

            def forward(self, x):
                x = F.relu(self.conv1(x))
                x = F.relu(self.conv2(x))
                x = F.max_pool2d(x, 2)
                x = self.dropout1(x)
                x = x.flatten(1)
                x = self.dropout2(F.relu(self.fc1(x)))
                return self.fc2(x)

        return Net()
    import torchvision

    if name == "resnet18":
        m = torchvision.models.resnet18(num_classes=10)
        m.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        m.maxpool = nn.Identity()
        return m
    return torchvision.models.resnet50()


def build_gpt(name):
    """nanoGPT's GPT (the copy the fixtures use; its attention the manual path of PyTorch 1.13)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures"))
    from nanogpt import GPT, GPTConfig
    return GPT(GPTConfig(**GPT_CONFIGS[name]))


def proc_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def reset_hwm():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run_one(name, mode, steps, warmup, threads, channels_last=False):
    import gc
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    batch, shape, classes = WORKLOADS[name]
    lm = name in GPT_CONFIGS
    model = (build_gpt(name) if lm else build(name)).train()
    if lm:   # ampc-bench's: nanoGPT's AdamW, weight decay on the Linear weights only
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "wte" not in n and "wpe" not in n]
        rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "wte" not in n and "wpe" not in n)]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                lr=6e-4, betas=(0.9, 0.95))
        x = torch.randint(0, classes, (batch, *shape))
        y = torch.randint(0, classes, (batch, *shape))
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x = torch.randn(batch, *shape)
        y = torch.randint(0, classes, (batch,))
    if channels_last and name != "mlp" and not lm:   # PyTorch's recipe: model and input both channels_last
        model = model.to(memory_format=torch.channels_last)
        x = x.to(memory_format=torch.channels_last)
    amp = mode == "amp-bf16"

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = model(x)[0] if lm else model(x)
            loss = F.cross_entropy(out.view(-1, out.size(-1)), y.view(-1)) if lm else F.cross_entropy(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    gc.collect()
    rss0 = proc_kib("VmRSS")
    hwm_ok = reset_hwm()
    for _ in range(warmup):
        step()
    ms = []
    loss = float("nan")
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step()
        ms.append((time.perf_counter() - t0) * 1e3)
    hwm = proc_kib("VmHWM")
    med = statistics.median(ms)
    with open("/proc/self/maps") as f:   # which BLAS the process actually loaded
        maps = f.read()
    blas = "openblas" if "openblas" in maps else "mkl" if "libmkl" in maps else "netlib" if "libblas" in maps else "?"
    allocator = "jemalloc" if "jemalloc" in maps else "tcmalloc" if "tcmalloc" in maps else "glibc"
    return {
        "workload": name, "mode": mode, "batch": batch, "threads": torch.get_num_threads(),
        "ms_median": med, "ms_min": min(ms), "ms_max": max(ms), "samples_per_s": batch / (med * 1e-3),
        "rss_growth_bytes": (hwm - rss0) * 1024 if hwm_ok and hwm >= 0 else -1,
        "final_loss": loss, "ms_steps": ms, "torch": torch.__version__, "blas": blas, "allocator": allocator,
    }


def cuda_step(name, mode, channels_last, batch=0, compiled=False):
    """(step, batch) for one config on the GPU, as ampc-bench --device cuda runs it:
    torch.autocast("cuda") with bf16 or fp16 (fp16 with torch.amp.GradScaler), fp32 with TF32 off
    for matmuls and convolutions, tf32 with both on; SGD momentum 0.9; cudnn.benchmark on, as the
    seed's users set it. step() runs one training step and returns loss.item() (synchronising, as
    ampc-bench's step does). compiled: the model through torch.compile."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    dev = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = mode == "tf32"
    b, shape, classes = WORKLOADS[name]
    b = batch or b
    model = build(name).train().to(dev)
    x = torch.randn(b, *shape, device=dev)
    y = torch.randint(0, classes, (b,), device=dev)
    if channels_last and name != "mlp":
        model = model.to(memory_format=torch.channels_last)
        x = x.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    amp = mode.startswith("amp-")
    dt = torch.float16 if mode == "amp-fp16" else torch.bfloat16
    scaler = torch.amp.GradScaler("cuda", enabled=mode == "amp-fp16")
    fwd = torch.compile(model) if compiled else model

    def step():
        with torch.autocast("cuda", dtype=dt, enabled=amp):
            loss = F.cross_entropy(fwd(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step, b


def run_one_cuda(name, mode, steps, warmup, channels_last, batch=0, compiled=False):
    """One config on the GPU (cuda_step), each step timed with CUDA events; compiled: its
    compilation in the warm-up steps."""
    import torch

    step, b = cuda_step(name, mode, channels_last, batch, compiled)
    for _ in range(max(warmup, 3 if compiled else 0)):
        step()
    torch.cuda.reset_peak_memory_stats()
    ms = []
    for _ in range(steps):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        loss = step()
        t1.record()
        t1.synchronize()
        ms.append(t0.elapsed_time(t1))
    med = statistics.median(ms)
    return {"workload": name, "mode": mode, "batch": b, "device": torch.cuda.get_device_name(),
            "peer": "torch.compile" if compiled else "eager", "cudnn_benchmark": True,
            "ms_median": med, "ms_min": min(ms), "ms_max": max(ms), "samples_per_s": b / (med * 1e-3),
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(), "final_loss": loss, "torch": torch.__version__}


def cuda_main(args):
    rows = []
    for w in args.workloads:
        for m in args.modes:
            for compiled in ([False, True] if args.compile == "yes" else [False]):
                if compiled and (w not in args.compile_workloads or m not in args.compile_modes):
                    continue
                r = run_one_cuda(w, m, args.steps, args.warmup, args.channels_last == "yes", args.batch, compiled)
                rows.append(r)
                print(f"{w:9s} {m:9s} {r['peer']:13s} batch {r['batch']:4d} {r['ms_median']:9.2f} ms/step "
                      f"{r['samples_per_s']:10.1f} samples/s peak {r['peak_allocated_bytes'] / 2**20:9.1f} MiB", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tool": "pytorch_peer", "device": "cuda", "results": rows}, f, indent=1)


# ---------------------------------------------------------------------------------------------
# Orchestration: one process per config


OPENBLAS_SYSTEM = "/usr/lib/x86_64-linux-gnu/openblas-pthread"
JEMALLOC_SYSTEM = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
# jemalloc's settings in Intel's PyTorch tuning guide (its launcher's): freed memory is kept
JEMALLOC_CONF = ("oversize_threshold:1,background_thread:true,metadata_thp:auto,dirty_decay_ms:9000000000,"
                 "muzzy_decay_ms:9000000000")


def debian_lib(root, package, path):
    """path inside Debian package `package`, unpacked under root with `apt-get download` (no root
    needed, the system left as it is); None when it can't be fetched."""
    root = os.path.abspath(root)
    lib = os.path.join(root, "root" + path)
    if not os.path.exists(lib):
        os.makedirs(root, exist_ok=True)
        sys.stderr.write(f"pytorch_peer: fetching Debian's {package} into {root}\n")
        try:
            subprocess.run(["apt-get", "download", package], cwd=root, check=True, capture_output=True, text=True)
            debs = sorted(f for f in os.listdir(root) if f.startswith(package) and f.endswith(".deb"))
            subprocess.run(["dpkg", "-x", os.path.join(root, debs[-1]), os.path.join(root, "root")], check=True)
        except (OSError, IndexError, subprocess.CalledProcessError) as e:
            sys.stderr.write(f"pytorch_peer: cannot get {package}: {e}\n")
            return None
    return lib if os.path.exists(lib) else None


def jemalloc_lib(args):
    if not hasattr(args, "_jemalloc"):
        args._jemalloc = JEMALLOC_SYSTEM if os.path.exists(JEMALLOC_SYSTEM) else \
            debian_lib(args.jemalloc_dir, "libjemalloc2", JEMALLOC_SYSTEM)
    return args._jemalloc


def openblas_lib_dir(args):
    """Directory holding OpenBLAS's libblas.so.3: the system's, or a private unpacked copy."""
    if os.path.exists(os.path.join(OPENBLAS_SYSTEM, "libblas.so.3")):
        return OPENBLAS_SYSTEM
    lib = debian_lib(args.openblas_dir, "libopenblas0-pthread", OPENBLAS_SYSTEM + "/libblas.so.3")
    if not lib:
        raise SystemExit("pytorch_peer: cannot get OpenBLAS; install libopenblas0-pthread or use --blas system")
    return os.path.dirname(lib)


ALLOCATORS = {"jemalloc": "jemalloc (preloaded, the guide's MALLOC_CONF)",
              "glibc": "glibc with MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ 4 GiB"}


def tuned_allocators(args):
    """The allocator setups a tuned config is timed with (jemalloc only where it can be had)."""
    names = ["jemalloc", "glibc"] if args.allocator == "best" else [args.allocator]
    if "jemalloc" in names and not jemalloc_lib(args):
        names = [n for n in names if n != "jemalloc"] or ["glibc"]
    return names


def peer_env(args, tuned, allocator="glibc"):
    """The environment of a PyTorch process: its BLAS and, tuned, the guide's OpenMP settings and
    allocator setup `allocator` (jemalloc or glibc, ALLOCATORS)."""
    env = dict(os.environ)
    if tuned:
        lib = jemalloc_lib(args) if allocator == "jemalloc" else None
        if lib:
            env["LD_PRELOAD"] = lib + (":" + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
            env["MALLOC_CONF"] = JEMALLOC_CONF
        else:   # the same effect from glibc: large blocks kept, never trimmed
            env["MALLOC_MMAP_THRESHOLD_"] = env["MALLOC_TRIM_THRESHOLD_"] = "4294967296"
        env.update(OMP_NUM_THREADS=str(args.threads), OMP_SCHEDULE="STATIC", OMP_PROC_BIND="CLOSE",
                   GOMP_CPU_AFFINITY=f"0-{args.threads - 1}")
    if args.blas == "openblas":
        if not hasattr(args, "_openblas"):
            args._openblas = openblas_lib_dir(args)
        env["LD_LIBRARY_PATH"] = args._openblas + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
        env["OPENBLAS_NUM_THREADS"] = str(args.threads)
        with open("/proc/cpuinfo") as f:
            if " avx512f" in f.read():
                env.setdefault("OPENBLAS_CORETYPE", "SkylakeX")
    return env


def run_peer_config(args, name, mode, tuned=None, allocator="glibc"):
    tuned = args.tuning == "guide" if tuned is None else tuned
    cl = args.channels_last if args.channels_last != "auto" else "yes" if tuned else "no"
    cmd = [sys.executable, os.path.abspath(__file__), "--one", name, mode, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--threads", str(args.threads), "--channels-last", cl]
    p = subprocess.run(cmd, capture_output=True, text=True, env=peer_env(args, tuned, allocator))
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        raise SystemExit(f"pytorch_peer: {name} {mode} failed")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_ampc_config(args, name, mode, peak=False):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tf:
        path = tf.name
    try:
        if peak:
            cmd = [args.ampc_bench, "--peak", "--threads", str(args.threads), "--json", path]
        else:
            cmd = [args.ampc_bench, "--workloads", name, "--modes", mode, "--steps", str(args.steps), "--warmup",
                   str(args.warmup), "--threads", str(args.threads), "--no-peak", "--json", path,
                   "--channels-last", args.ampc_channels_last]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            sys.stderr.write(p.stdout + p.stderr)
            raise SystemExit(f"pytorch_peer: ampc-bench {' '.join(cmd[1:])} failed")
        with open(path) as f:
            data = json.load(f)
    finally:
        os.unlink(path)
    return data if peak else data["results"][0]


def median_of(runs, key):
    vals = [r[key] for r in runs if r.get(key, -1) is not None and r.get(key, -1) >= 0]
    return statistics.median(vals) if vals else -1


def compare(args):
    peak = run_ampc_config(args, None, None, peak=True)["peak"]
    rows = []
    for name in args.workloads:
        for mode in args.modes:
            a_runs, u_runs = [], []
            alloc_runs = {n: [] for n in (tuned_allocators(args) if args.tuning == "guide" else ["glibc"])}
            for _ in range(args.repeat):   # interleaved, so all see the same machine load
                a_runs.append(run_ampc_config(args, name, mode))
                if mode in TORCH_MODES:
                    for n, runs in alloc_runs.items():
                        runs.append(run_peer_config(args, name, mode, allocator=n))
                    if args.tuning == "guide":
                        u_runs.append(run_peer_config(args, name, mode, tuned=False))
            # the tuned figure: the allocator setup with the faster median
            t_alloc = min(alloc_runs, key=lambda n: median_of(alloc_runs[n], "ms_median") if alloc_runs[n] else 0)
            t_runs = alloc_runs[t_alloc]
            a = a_runs[0]
            row = {"workload": name, "mode": mode, "batch": a["batch"], "gflop_per_step": a["gflop_per_step"],
                   "ampc_ms": median_of(a_runs, "ms_median"),
                   "ampc_alloc_peak_bytes": median_of([r["mem_peak_bytes"] for r in a_runs], "total"),
                   "ampc_rss_growth_bytes": median_of(a_runs, "rss_growth_bytes"),
                   "ampc_ms_runs": [r["ms_median"] for r in a_runs]}
            if t_runs:
                row.update({"torch_ms": median_of(t_runs, "ms_median"), "torch_blas": t_runs[0]["blas"],
                            "torch_allocator": t_runs[0]["allocator"] if args.tuning == "guide" else "as-is",
                            "torch_ms_by_allocator": {n: median_of(r, "ms_median") for n, r in alloc_runs.items()},
                            "torch_rss_growth_bytes": median_of(t_runs, "rss_growth_bytes"),
                            "torch_ms_runs": [r["ms_median"] for r in t_runs]})
            if u_runs:
                row.update({"torch_untuned_ms": median_of(u_runs, "ms_median"),
                            "torch_untuned_ms_runs": [r["ms_median"] for r in u_runs]})
            rows.append(row)
            args.torch_version = t_runs[0]["torch"] if t_runs else getattr(args, "torch_version", "?")
            sys.stderr.write(f"  {name:9s} {mode:9s} ampc {row['ampc_ms']:9.2f} ms"
                             + (f"  torch {row['torch_ms']:9.2f} ms" if t_runs else "")
                             + (f"  untuned {row['torch_untuned_ms']:9.2f} ms" if u_runs else "") + "\n")
    # again at the end, keeping the larger figures (a busy core lowers one measurement only)
    peak2 = run_ampc_config(args, None, None, peak=True)["peak"]
    if peak and peak2:
        peak = {k: max(v, peak2[k]) if isinstance(v, (int, float)) else v for k, v in peak.items()}
    print_table(args, peak, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"peak": peak, "threads": args.threads, "steps": args.steps, "warmup": args.warmup,
                       "repeat": args.repeat, "blas": args.blas, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
                       "tuning": args.tuning, "allocators": tuned_allocators(args) if args.tuning == "guide" else [],
                       "rows": rows}, f, indent=1)


def print_table(args, peak, rows):
    def pct(gflop, ms, mode):
        p = peak and (peak["bf16_gflops_peak"] if mode == "amp-bf16" else peak["fp32_gflops_peak"])
        return f"{100 * gflop / (ms * 1e-3) / p:5.1f}%" if p and ms > 0 else "    -"

    def mib(b):
        return f"{b / 2**20:8.1f}" if b is not None and b >= 0 else "       -"

    blas = next((r["torch_blas"] for r in rows if "torch_blas" in r), "?")
    print(f"\nampc vs PyTorch {args.torch_version} (fp32 Linear on {blas} BLAS): {args.threads} threads, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, {args.steps} timed steps after "
          f"{args.warmup} warm-up, median of {args.repeat} run(s) of each (one process per run)")
    fmt = {"yes": "channels-last", "no": "contiguous (NCHW)"}
    torch_cl = args.channels_last if args.channels_last != "auto" else "yes" if args.tuning == "guide" else "no"
    print(f"conv nets: ampc {fmt[args.ampc_channels_last]}, PyTorch {fmt[torch_cl]}")
    if args.tuning == "guide":
        names = tuned_allocators(args)
        print(f"PyTorch tuned as its CPU guide says: OMP_PROC_BIND=CLOSE, GOMP_CPU_AFFINITY=0-{args.threads - 1}, "
              + ("the faster per config (column 'alloc') of " if len(names) > 1 else "")
              + " and ".join(ALLOCATORS[n] for n in names)
              + "; 'untuned': as installed (glibc malloc, no binding, NCHW)")
    if peak:
        print(f"peak on {peak['threads']} threads (per-core x threads): fp32 {peak['fp32_gflops_peak']:.0f} GFLOP/s, "
              f"bf16 {peak['bf16_gflops_peak']:.0f} GFLOP/s (measured on all threads at once: "
              f"{peak['fp32_gflops_all']:.0f}, {peak['bf16_gflops_all']:.0f})")
    print(f"{'workload':9s} {'mode':9s} {'ampc ms':>9s} {'torch ms':>9s} {'ampc/torch':>10s} {'alloc':>8s} {'untuned':>9s} "
          f"{'ampc/unt':>8s} {'ampc/best':>9s} {'ampc %pk':>8s} {'torch %pk':>9s} {'ampc MiB':>8s} {'ampc RSS':>8s} {'torch RSS':>9s}")
    for r in rows:
        t, u = r.get("torch_ms"), r.get("torch_untuned_ms")
        print(f"{r['workload']:9s} {r['mode']:9s} {r['ampc_ms']:9.2f} "
              + (f"{t:9.2f} {r['ampc_ms'] / t:10.2f} {r['torch_allocator']:>8.8s} " if t else f"{'-':>9s} {'-':>10s} {'-':>8s} ")
              + (f"{u:9.2f} {r['ampc_ms'] / u:8.2f} " if u else f"{'-':>9s} {'-':>8s} ")
              + (f"{r['ampc_ms'] / min(x for x in (t, u) if x):9.2f} " if t or u else f"{'-':>9s} ")
              + f"{pct(r['gflop_per_step'], r['ampc_ms'], r['mode']):>8s} "
              + (f"{pct(r['gflop_per_step'], min(x for x in (t, u) if x), r['mode']):>9s} " if t or u else f"{'-':>9s} ")
              + f"{mib(r['ampc_alloc_peak_bytes'])} {mib(r['ampc_rss_growth_bytes'])} "
              + f" {mib(r.get('torch_rss_growth_bytes'))}")
    print("ampc/torch: time ratio (< 1: ampc faster); ampc/best: against the faster PyTorch, tuned or as installed\n"
          "(torch %pk is that one's). ampc MiB: allocator peak (all kinds); RSS: resident-set\n"
          "growth over the warm-up and timed steps of a fresh process (MiB). %pk: analytic FLOPs over the peak.")


# ---------------------------------------------------------------------------------------------
# Command line


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="mlp,cnn,resnet18")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: torch.autocast('cuda') + GradScaler on the GPU (modes fp32, tf32, amp-bf16, amp-fp16)")
    ap.add_argument("--batch", type=int, default=0, help="samples per step for every workload (cuda; 0: their own)")
    ap.add_argument("--resnet50", action="store_true", help="add resnet50")
    ap.add_argument("--modes", default=None, help="default fp32,amp-bf16 (with --compare: also amp-fp16)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeat", type=int, default=1, help="runs per config; the median is reported")
    ap.add_argument("--compare", action="store_true", help="run ampc-bench too and print one table")
    ap.add_argument("--ampc-bench", default="build/ampc-bench")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--blas", choices=("openblas", "system"), default="openblas",
                    help="BLAS for PyTorch's fp32 Linear (default openblas; system: as installed)")
    ap.add_argument("--openblas-dir", default="build/peer-openblas", help="where to unpack OpenBLAS if not installed")
    ap.add_argument("--tuning", choices=("guide", "none"), default="guide",
                    help="guide (default): PyTorch as its CPU tuning guide sets it up (an allocator that keeps memory, thread binding, "
                         "channels_last); none: as installed. --compare with guide also times 'none'")
    ap.add_argument("--jemalloc-dir", default="build/peer-jemalloc", help="where to unpack jemalloc if not installed")
    ap.add_argument("--allocator", choices=("best", "jemalloc", "glibc"), default="best",
                    help="tuned PyTorch's allocator setup: best (default): both timed, the faster kept per config; "
                         "jemalloc: the guide's jemalloc; glibc: malloc with the 4 GiB mmap/trim thresholds")
    ap.add_argument("--channels-last", choices=("auto", "yes", "no"), default="auto",
                    help="PyTorch's conv nets and inputs in torch.channels_last (auto: yes when tuned, as the guide says)")
    ap.add_argument("--ampc-channels-last", choices=("yes", "no"), default="yes",
                    help="ampc-bench --channels-last (default yes: ampc-bench's default)")
    ap.add_argument("--compile", choices=("yes", "no"), default="no",
                    help="cuda: also time the model through torch.compile (a second peer)")
    ap.add_argument("--compile-workloads", default="resnet50", help="cuda: the workloads --compile runs (default resnet50)")
    ap.add_argument("--compile-modes", default="amp-fp16", help="cuda: the modes --compile runs (default amp-fp16)")
    ap.add_argument("--one", nargs=2, metavar=("WORKLOAD", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.device == "cuda":   # in this process, all configs (the GPU's numbers need no fresh RSS)
        args.workloads = [w for w in args.workloads.split(",") if w]
        args.modes = (args.modes or "fp32,tf32,amp-bf16,amp-fp16").split(",")
        args.compile_workloads = [w for w in args.compile_workloads.split(",") if w]
        args.compile_modes = [m for m in args.compile_modes.split(",") if m]
        cuda_main(args)
        return
    if args.one:
        print(json.dumps(run_one(args.one[0], args.one[1], args.steps, args.warmup, args.threads,
                                 args.channels_last == "yes")))
        return
    args.workloads = [w for w in args.workloads.split(",") if w]
    if args.resnet50 and "resnet50" not in args.workloads:
        args.workloads.append("resnet50")
    args.modes = (args.modes or ",".join(ALL_MODES if args.compare else TORCH_MODES)).split(",")
    for w in args.workloads:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w} (known: {', '.join(WORKLOADS)})")
    for m in args.modes:
        if m not in ALL_MODES or (m not in TORCH_MODES and not args.compare):
            ap.error(f"unknown mode {m} (PyTorch: {', '.join(TORCH_MODES)}; with --compare also amp-fp16)")
    if args.steps < 1 or args.warmup < 0 or args.repeat < 1 or args.threads < 1:
        ap.error("--steps, --repeat and --threads must be >= 1, --warmup >= 0")
    if args.compare:
        compare(args)
        return
    results = []
    for w in args.workloads:
        for m in args.modes:
            names = tuned_allocators(args) if args.tuning == "guide" else ["glibc"]
            by = {n: [] for n in names}
            for _ in range(args.repeat):   # interleaved
                for n in names:
                    by[n].append(run_peer_config(args, w, m, allocator=n))
            runs = by[min(names, key=lambda n: median_of(by[n], "ms_median"))]   # the faster setup's
            r = runs[0] if len(runs) == 1 else dict(runs[0], ms_median=median_of(runs, "ms_median"),
                                                    ms_runs=[x["ms_median"] for x in runs])
            results.append(r)
            sys.stderr.write(f"  {w:9s} {m:9s} {r['ms_median']:9.2f} ms/step\n")
    out = {"tool": "pytorch_peer", "threads": args.threads, "steps": args.steps, "warmup": args.warmup,
           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"), "results": results}
    text = json.dumps(out, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
