"""Which XLA debug-option values this jaxlib takes by default: the ones jaxkv's step options
build on (jaxkv/runner/xla_options.py).

  python -m benchmarks.xla_defaults      # one JSON line; gpu_flags.sh writes it beside its rows

XLA dumps a program's debug options (`--xla_dump_to`, the `*.debug_options` file) as the
fields that differ from their defaults, so a value is the default exactly when, set in
XLA_FLAGS, it leaves no line for its option there. Each check compiles a trivial program in a
child process (XLA reads XLA_FLAGS once per process), on the default platform.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile

_PROGRAM = "import jax, jax.numpy as jnp\njax.jit(lambda x: x + 1).lower(jnp.ones(3)).compile()\n"


def is_default(option: str, value) -> bool:
    """Whether `value` is this jaxlib's default for XLA debug option `option` (a bool as
    true/false). Raises RuntimeError when the child process fails (an unknown option or
    value) or XLA wrote no debug options."""
    text = str(value).lower() if isinstance(value, bool) else str(value)
    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "XLA_FLAGS": f"--xla_dump_to={d} --{option}={text}"}
        p = subprocess.run([sys.executable, "-c", _PROGRAM], env=env, capture_output=True,
                           text=True, timeout=300)
        if p.returncode:
            raise RuntimeError(f"{option}={text}: {p.stderr.strip().splitlines()[-1:]}")
        files = glob.glob(os.path.join(d, "*lambda*.debug_options"))
        if not files:
            raise RuntimeError(f"{option}={text}: XLA wrote no debug options under {d}")
        with open(files[0]) as f:
            return not any(line.startswith(option + ":") for line in f)


def main() -> None:
    from jaxkv.runner.xla_options import XLA_DEFAULT_TYPES
    merger = next((mb for mb in (64, 32) if is_default("xla_gpu_dot_merger_threshold_mb", mb)), None)
    print(json.dumps({"xla_default_types": XLA_DEFAULT_TYPES,
                      "xla_default_types_match": is_default("xla_gpu_enable_command_buffer",
                                                            XLA_DEFAULT_TYPES),
                      "dot_merger_threshold_mb": merger}))


if __name__ == "__main__":
    main()
