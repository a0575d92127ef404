#!/usr/bin/env python3
"""pth_to_safetensors.py - a PyTorch .pth/.pt state_dict to a safetensors file for ampc
(`ampc-train --pretrained FILE`, `ampc_load_state_dict`).

    python3 scripts/pth_to_safetensors.py resnet50-weights.pth resnet50.safetensors

Needs torch and nothing else (the file is written with json and struct). Takes a state_dict, or
a checkpoint dict holding one under "state_dict", "model" or "model_state_dict"; strips the
"module." prefix that DataParallel/DDP add; writes every tensor contiguous, in its dtype
(float32, float16, bfloat16, float64, int64), names sorted, metadata {"format": "pt"}.
torchvision's names are ampc's for resnet18/resnet50, so torchvision's pretrained weights load
as they are (strictly for the same classes; with --pretrained-strict head for another head).
"""
import json
import struct
import sys

import torch

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64", torch.int64: "I64"}


def state_dict_of(obj):
    if isinstance(obj, dict):
        for key in ("state_dict", "model", "model_state_dict"):
            if key in obj and isinstance(obj[key], dict):
                return obj[key]
        return obj
    if hasattr(obj, "state_dict"):
        return obj.state_dict()
    sys.exit("no state_dict in the file")


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sd = state_dict_of(torch.load(sys.argv[1], map_location="cpu"))
    tensors = {}
    for name, t in sd.items():
        if not isinstance(t, torch.Tensor):
            continue
        if t.dtype not in DTYPES:
            sys.exit("tensor %s has dtype %s, which ampc does not read" % (name, t.dtype))
        tensors[name[7:] if name.startswith("module.") else name] = t.detach().contiguous()
    header, blobs, at = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        raw = tensors[name].reshape(-1).view(torch.uint8).numpy().tobytes() if tensors[name].numel() else b""
        header[name] = {"dtype": DTYPES[tensors[name].dtype], "shape": list(tensors[name].shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)
    with open(sys.argv[2], "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))
    print("%s: %d tensors" % (sys.argv[2], len(tensors)))


if __name__ == "__main__":
    main()
