#!/usr/bin/env python3
"""Reads safetensors files and cohort checkpoints without cohort or the safetensors library.

    read_safetensors.py FILE.safetensors   print each tensor: name dtype shape sum
    read_safetensors.py STEP_DIR           verify manifest.json (sizes, CRC32C),
                                           then print every file's tensors

Uses only the standard library; numpy, if importable, does the arithmetic.
The format is in docs/checkpoint-format.md. Exit status 1 on a bad file.
"""
import json
import os
import struct
import sys

try:
    import numpy as np
except ImportError:
    np = None

# safetensors dtype -> struct code (BF16 is read as raw u16 and widened below).
CODES = {"F64": "d", "F32": "f", "F16": "e", "BF16": "H", "I64": "q", "I32": "i", "I8": "b", "U8": "B"}
NUMPY = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8", "I32": "<i4", "I8": "i1", "U8": "u1"}


def read_safetensors(path):
    """Returns (metadata, {name: (dtype, shape, raw bytes)}), checking offsets like the format requires."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise ValueError(f"{path}: header length {n} runs past the end of the file")
    header = json.loads(data[8:8 + n])
    metadata = header.pop("__metadata__", {})
    buf = data[8 + n:]
    tensors, end = {}, 0
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
        begin, stop = info["data_offsets"]
        if begin != end or stop > len(buf):
            raise ValueError(f"{path}: tensor {name} has bad data_offsets {info['data_offsets']}")
        end = stop
        tensors[name] = (info["dtype"], info["shape"], buf[begin:stop])
    if end != len(buf):
        raise ValueError(f"{path}: {len(buf) - end} trailing bytes belong to no tensor")
    return metadata, tensors


def tensor_sum(dtype, raw):
    if np is not None:
        a = np.frombuffer(raw, dtype=NUMPY[dtype])
        if dtype == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        return float(a.astype(np.float64).sum())
    code = CODES[dtype]
    values = struct.unpack("<%d%s" % (len(raw) // struct.calcsize(code), code), raw)
    if dtype == "BF16":
        values = [struct.unpack("<f", struct.pack("<I", v << 16))[0] for v in values]
    return float(sum(values))


def crc32c(data, crc=0):
    """CRC32C (Castagnoli, reflected 0x82F63B78), one byte at a time: slow, for small files."""
    table = crc32c.table
    crc ^= 0xFFFFFFFF
    for b in data:
        crc = (crc >> 8) ^ table[(crc ^ b) & 0xFF]
    return crc ^ 0xFFFFFFFF


def _table():
    out = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        out.append(c)
    return out


crc32c.table = _table()


def print_file(path, label=""):
    metadata, tensors = read_safetensors(path)
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        print(f"{label}{name} {dtype} {shape} {tensor_sum(dtype, raw):.6f}")
    return metadata


def main(argv):
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    target = argv[1]
    print("backend:", "numpy" if np is not None else "struct", file=sys.stderr)
    try:
        if not os.path.isdir(target):
            print_file(target)
            return 0
        with open(os.path.join(target, "manifest.json")) as f:
            manifest = json.load(f)
        if manifest.get("complete") is not True:
            raise ValueError(f"{target}: manifest is not marked complete")
        print(f"step {manifest['step']} epoch {manifest['epoch']} world_size {manifest['world_size']}")
        for name in sorted(manifest["files"]):
            info = manifest["files"][name]
            path = os.path.join(target, name)
            with open(path, "rb") as f:
                data = f.read()
            crc = f"{crc32c(data):08x}"
            if len(data) != info["size"] or crc != info["crc32c"]:
                raise ValueError(f"{path}: size {len(data)} crc32c {crc}, manifest says {info['size']} {info['crc32c']}")
            print(f"file {name} size {len(data)} crc32c {crc} ok")
            print_file(path, label=name[: -len(".safetensors")] + "/")
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
