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

POINTER_TYPES = {"indices": "*i64", "order": "*i64", "row_starts": "*i64", "weights": "*fp32", "grad_weights": "*fp32"}
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def resource_usage(arch: int, dtype: str) -> dict[str, str]:
    block_l, block_d = kernels._blocks(128, 1024)
    usage = {}
    for kernel in (kernels._read_kernel, kernels._weights_grad_kernel, kernels._table_grad_kernel):
        names = kernel.arg_names
        signature = {name: "constexpr" if name.startswith("BLOCK") else "i32" if name in ("L", "D")
                     else POINTER_TYPES.get(name, f"*{dtype}") for name in names}
        constants = {name: block_d if name == "BLOCK_D" else block_l for name in names if name.startswith("BLOCK")}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                                  target=GPUTarget("cuda", arch, 32))
        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp) / "kernel.cubin"
            cubin.write_bytes(compiled.asm["cubin"])
            dump = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", str(cubin)], capture_output=True,
                                  text=True, check=True).stdout
        usage[kernel.fn.__name__] = next(line.strip() for line in dump.splitlines() if "REG:" in line)
    return usage


if __name__ == "__main__":
    print(json.dumps({target: resource_usage(int(target.split(":")[0]), target.split(":")[1])
                      for target in sys.argv[1:]}))
