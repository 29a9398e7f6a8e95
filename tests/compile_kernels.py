"""Compiles the fused value-read kernels for a GPU architecture, on any machine (no GPU needed), and
prints each kernel's resource usage as JSON. Run without TRITON_INTERPRET (the interpreter replaces
the compiler's builders):

    python tests/compile_kernels.py 90:bf16 80:fp32   # {"90:bf16": {"_read_kernel": "REG:114 STACK:0 ..."}, ...}

Tile sizes are those the paper's shapes get: heads·knn = 128 lookups per token, dim 1024.
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from xlm_pkm.model.memory import triton_value_read as kernels  # noqa: E402

POINTER_TYPES = {"indices": "*i64", "order": "*i64", "row_starts": "*i64", "slots": "*i64", "weights": "*fp32",
                 "grad_weights": "*fp32"}
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def tiles(elem: int) -> dict[str, tuple]:
    """name -> (kernel, its tile constants, warps) at the paper's shapes for a table of `elem`-byte values; the
    table gradient's tile (and the one-pass backward's) follows a slot's mean number of reads, so it is compiled
    at both ends: read once, and 32 times or more."""
    (block_l, block_d), grad = kernels._blocks(128, 1024, elem), kernels._grad_blocks
    return {"_read_kernel": (kernels._read_kernel, {"BLOCK_L": block_l, "BLOCK_D": block_d}, 4),
            "_weights_grad_kernel": (kernels._weights_grad_kernel,
                                     dict(zip(("BLOCK_L", "BLOCK_D"), grad(128, 1024))), 4),
            **{f"_table_grad_kernel@{reads}": (kernels._table_grad_kernel, dict(zip(
                ("BLOCK_E", "BLOCK_D"), grad(reads, 1024, kernels.TABLE_GRAD_ROWS))), kernels.TABLE_GRAD_WARPS)
               for reads in (1, 32)},
            **{f"_one_pass_grad_kernel@{reads}": (kernels._one_pass_grad_kernel, dict(zip(
                ("BLOCK_E", "BLOCK_D"), grad(reads, 1024, kernels.TABLE_GRAD_ROWS))), kernels.TABLE_GRAD_WARPS)
               for reads in (1, 32)}}


def resource_usage(arch: int, dtype: str) -> dict[str, str]:
    usage = {}
    for name, (kernel, constants, warps) in tiles(ELEMENT_BYTES[dtype]).items():
        signature = {arg: "constexpr" if arg in constants else "i32" if arg in ("L", "D")
                     else POINTER_TYPES.get(arg, f"*{dtype}") for arg in kernel.arg_names}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                                  target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp) / "kernel.cubin"
            cubin.write_bytes(compiled.asm["cubin"])
            dump = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", str(cubin)], capture_output=True,
                                  text=True, check=True).stdout
        usage[name] = next(line.strip() for line in dump.splitlines() if "REG:" in line)
    return usage


if __name__ == "__main__":
    print(json.dumps({target: resource_usage(int(target.split(":")[0]), target.split(":")[1])
                      for target in sys.argv[1:]}))
