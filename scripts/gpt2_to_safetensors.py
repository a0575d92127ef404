#!/usr/bin/env python3
"""gpt2_to_safetensors.py - Hugging Face's GPT-2 weights (model.safetensors of gpt2, gpt2-medium,
...) to the state_dict of ampc's zoo "gpt" (nanoGPT's names), for `ampc-train --model gpt
--pretrained FILE` and `ampc_load_state_dict`.

    python3 scripts/gpt2_to_safetensors.py gpt2/model.safetensors gpt2-ampc.safetensors

Pure Python (json, struct, array): no torch, no numpy. What changes, as nanoGPT's
GPT.from_pretrained does it:
- names gain "transformer." ("h.0.attn.c_attn.weight" -> "transformer.h.0.attn.c_attn.weight";
  a file that has the prefix already keeps it);
- Hugging Face's Conv1D layers (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj) store their weight
  as (in, out); a Linear's is (out, in): those four weights are transposed;
- the causal-mask buffers (attn.bias, attn.masked_bias) are dropped;
- lm_head.weight is written as a copy of transformer.wte.weight (the tie: ampc's state_dict lists
  it under both names, as PyTorch's does).
Every tensor keeps its dtype (F32, F16, BF16); names are written sorted, with metadata
{"format": "pt"}. The GPTConfig to give ampc-train: --n-layer (the number of h.N blocks),
--n-embd (wte's width), --block-size up to wpe's rows; the vocabulary (50257) comes from the data
(llm.c's .bin of GPT-2 tokens). The script prints them.
"""
import array
import json
import struct
import sys

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
SIZES = {"F32": 4, "F16": 2, "BF16": 2}
CODES = {4: "f", 2: "H"}   # array typecodes by element size (16-bit values moved as raw halves)


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        a, b = e["data_offsets"]
        out[name] = (e["dtype"], list(e["shape"]), data[base + a:base + b])
    return out


def transpose(dtype, shape, raw):
    """(rows, cols) -> (cols, rows), element by element through array slices."""
    if dtype not in SIZES:
        sys.exit(f"gpt2_to_safetensors: a {dtype} weight; expected F32, F16 or BF16")
    rows, cols = shape
    a = array.array(CODES[SIZES[dtype]])
    a.frombytes(raw)
    if sys.byteorder != "little":
        a.byteswap()
    t = array.array(a.typecode, bytes(len(raw)))
    for c in range(cols):   # column c of a is row c of t
        t[c * rows:(c + 1) * rows] = a[c::cols]
    if sys.byteorder != "little":
        t.byteswap()
    return [cols, rows], t.tobytes()


def convert(src):
    out = {}
    for name, (dtype, shape, raw) in src.items():
        key = name[len("transformer."):] if name.startswith("transformer.") else name
        if key.endswith(".attn.bias") or key.endswith(".attn.masked_bias"):
            continue   # the causal mask, not a weight
        if key == "lm_head.weight":
            continue   # written below, as the tie
        if any(key.endswith(c) for c in CONV1D):
            if len(shape) != 2:
                sys.exit(f"gpt2_to_safetensors: {name} has shape {shape}, not a Conv1D weight's (in, out)")
            shape, raw = transpose(dtype, shape, raw)
        out["transformer." + key] = (dtype, shape, raw)
    if "transformer.wte.weight" not in out:
        sys.exit("gpt2_to_safetensors: no wte.weight: not a GPT-2 state_dict")
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def write_safetensors(path, tensors):
    header, offset, blobs = {"__metadata__": {"format": "pt"}}, 0, []
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    out = convert(read_safetensors(sys.argv[1]))
    write_safetensors(sys.argv[2], out)
    layers = 1 + max(int(k.split(".")[2]) for k in out if k.startswith("transformer.h."))
    vocab, width = out["transformer.wte.weight"][1]
    block = out["transformer.wpe.weight"][1][0]
    bias = "yes" if "transformer.ln_f.bias" in out else "no"
    print(f"{sys.argv[2]}: {len(out)} tensors; ampc-train --model gpt --n-layer {layers} --n-embd {width} "
          f"--block-size {block} (at most) --bias {bias}; vocabulary {vocab}; --n-head as the model's config.json says")


if __name__ == "__main__":
    main()
