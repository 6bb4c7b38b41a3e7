"""Run a module (`python -m benchmarks.forbid_imports MODULE ARGS...`) and fail if it imported
a package the lent GPU machine lacks (gguf, fastapi, pydantic) or jaxkv's GGUF reader / the HTTP
server. On a CPU box that has them, this is how the dry run proves the device run will not need
them; on the device a stray import would fail by itself."""

import runpy
import sys

FORBIDDEN = ("gguf", "fastapi", "pydantic", "serve")


def offenders() -> list[str]:
    return sorted(m for m in sys.modules
                  if m.split(".")[0] in FORBIDDEN or m == "jaxkv.loader.gguf")


def main() -> None:
    module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    bad = offenders()
    if bad:
        print(f"forbid_imports: {module} imported {bad}, which the GPU machine lacks", file=sys.stderr)
        code = code or 3
    sys.exit(code)


if __name__ == "__main__":
    main()
