"""Build a slim FlashInfer tarball that a device call can carry (paged-KV attention with LSE, state merge).

    python benchmarks/flashinfer_carry.py --wheel flashinfer_python-0.7.2.post1-py3-none-any.whl \
        --out .whl/flashinfer_slim.tgz --check

The wheel alone is 62 MB against a device call's 64 MiB (working tree included). The tarball keeps:

- ``site/flashinfer``: the Python package without the subpackages in ``DENY`` (MoE, GEMM, experimental,
  CuTe DSL, ...), its ``__init__`` replaced by one that imports only the paged-KV prefill / decode wrappers
  and the state merges; ``site/flashinfer/data``: the csrc files the JIT spec generators read (recorded while
  they run) or list as sources, every header the sources reach by ``#include`` through the include dirs of
  ``flashinfer/jit/cpp_ext.py`` (followed regardless of ``#if``), and cccl's three include trees whole
  (toolkit headers and cute's ``CUDA_STD_HEADER(x)`` reach libcudacxx by macro or from outside).
- ``site``: apache-tvm-ffi (cp312 binary, loads the built modules) and nvidia-ml-py (``pynvml``).
- ``fallback``: dependencies a torch image usually has already (pure Python but markupsafe and
  charset-normalizer, cp312 builds; a script appends the folder to the end of ``sys.path``) and
  ``fallback/bin/ninja``.

Dependency wheels come from ``pip download`` for CPython 3.12, manylinux x86_64 (the device's Python).
``--check`` unpacks the tarball, imports it in a fresh interpreter (with this Python's own tvm-ffi in a
``pip install --target`` folder), builds the JIT specs (FA2 and FA3 batch prefill, batch decode, cascade;
bf16, head dim 128, sm_90a), prints their sources and the nvcc command ninja would run, and where gcc and
the CUDA headers are here, preprocesses every source against the slim tree (device and host passes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

DENY = ("data", "experimental", "moe_ep", "fused_moe", "gemm", "gdn_kernels", "kda_kernels", "prims_ts",
        "comm", "topk_varlen", "msa_ops", "mamba", "diffusion_ops", "grouped_mm", "dsv3_ops",
        "parallel_attention", "trace_apply", "logits_processor", "tuning_configs", "profiler", "cute_dsl",
        "attention/cute_dsl", "attention/kernels", "attention/prims_ts")  # fmt: skip
KEEP = ("cute_dsl/__init__.py", "cute_dsl/availability.py")  # quantization imports the availability probe
INCLUDE_DIRS = ("cccl/cub", "cccl/libcudacxx/include", "cccl/thrust", "include", "csrc", "cutlass/include",
                "cutlass/tools/util/include", "spdlog/include")  # fmt: skip
CCCL_TREES = ("cccl/cub/cub", "cccl/thrust/thrust", "cccl/libcudacxx/include")
SITE_DEPS = ("apache-tvm-ffi<0.2,>=0.1.11", "nvidia-ml-py")
FALLBACK_DEPS = ("requests", "urllib3", "idna", "certifi", "charset-normalizer", "tqdm", "packaging", "filelock",
                 "jinja2", "markupsafe", "typing-extensions", "ninja")  # fmt: skip
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
INIT = '''"""FlashInfer, trimmed by pdllm's benchmarks/flashinfer_carry.py to paged-KV attention and merges."""

from .version import __version__ as __version__
from . import jit as jit
from .decode import BatchDecodeWithPagedKVCacheWrapper as BatchDecodeWithPagedKVCacheWrapper
from .prefill import BatchPrefillWithPagedKVCacheWrapper as BatchPrefillWithPagedKVCacheWrapper
from .prefill import BatchPrefillWithRaggedKVCacheWrapper as BatchPrefillWithRaggedKVCacheWrapper
from .cascade import merge_state as merge_state
from .cascade import merge_state_in_place as merge_state_in_place
from .cascade import merge_states as merge_states
'''
# Run in a fresh interpreter against a tree: builds the specs and reports the files under FI_DATA it opened.
GEN = r"""
import json, os, sys
data, opened = os.environ["FI_DATA"], set()
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, os.PathLike)) and str(args[0]).startswith(data):
        opened.add(os.path.realpath(str(args[0])))
sys.addaudithook(hook)
import torch
from flashinfer.jit.attention import modules as m
from flashinfer.jit.cascade import gen_cascade_module
bf, i32 = torch.bfloat16, torch.int32
args = (bf, bf, bf, i32, 128, 128, 0, False, False, False)
specs = {"prefill_fa2_equal_strides": m._gen_batch_prefill_primary_module("fa2", *args),
         "prefill_fa2_paged_independent": m._gen_batch_prefill_independent_paged_module("fa2", *args),
         "prefill_fa2": m.gen_batch_prefill_module("fa2", *args),
         "prefill_fa3_sm90": m.gen_batch_prefill_module("fa3", *args),
         "decode": m.gen_batch_decode_module(bf, bf, bf, i32, 128, 128, 0, False, False),
         "cascade": gen_cascade_module()}
out = {}
for key, s in specs.items():
    s.write_ninja()
    out[key] = {"name": s.name, "sources": [str(p) for p in s.sources], "ninja": str(s.ninja_path)}
mods = sorted(k for k in sys.modules if k.startswith("flashinfer"))
print("@@" + json.dumps({"specs": out, "opened": sorted(opened), "modules": mods}))
"""
INC = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


def pip(*args: str) -> None:
    if (r := subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True)).returncode:
        raise SystemExit(f"pip {args[0]} failed:\n{r.stderr.decode()[-2000:]}")


def download(work: Path) -> Path:
    """cp312 manylinux wheels of the dependencies (kept in ``work/wheels`` across runs)."""
    wheels = work / "wheels"
    if not any(wheels.glob("apache_tvm_ffi-*.whl")):
        plat = [f"--platform={p}" for p in PLATFORMS]
        pip("download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", *plat, "-d", str(wheels),
            *SITE_DEPS, *FALLBACK_DEPS)  # fmt: skip
    return wheels


def unzip(whl: Path, dest: Path) -> None:
    """A wheel's files under ``dest`` (``*.data/scripts`` go to ``dest/bin``, modes kept)."""
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            name = info.filename
            if name.endswith("/") or ".dist-info/RECORD" in name:
                continue
            target = dest / re.sub(r"^[^/]+\.data/scripts/", "bin/", name)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(info))
            mode = info.external_attr >> 16 & 0o777
            target.chmod(mode | 0o644 if mode else 0o644)


def python_tree(full: Path, site: Path) -> int:
    """Copy flashinfer's package files outside ``DENY`` (plus ``KEEP``); returns the file count."""
    pkg, n = full / "flashinfer", 0
    for path in sorted(pkg.rglob("*")):
        rel = path.relative_to(pkg).as_posix()
        denied = any(rel == d or rel.startswith(d + "/") for d in DENY) and rel not in KEEP
        if path.is_file() and not denied and "__pycache__" not in rel:
            (site / "flashinfer" / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, site / "flashinfer" / rel)
            n += 1
    (site / "flashinfer" / "__init__.py").write_text(INIT)
    for lic in [p for p in full.glob("flashinfer_python-*.dist-info/licenses/**/*") if p.is_file()]:
        (site / "flashinfer" / "LICENSES").mkdir(exist_ok=True)
        shutil.copy2(lic, site / "flashinfer" / "LICENSES" / lic.name)
    return n


def generate(site: Path, local: Path, fallback: Path | None, ws: Path) -> dict:
    """Run ``GEN`` against ``site``, its JIT workspace (generated sources, ninja files) in ``ws``."""
    env = {**os.environ, "PYTHONPATH": f"{local}{os.pathsep}{site}", "FLASHINFER_WORKSPACE_BASE": str(ws),
           "FI_DATA": os.path.realpath(site / "flashinfer" / "data")}  # fmt: skip
    env.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")  # no GPU here to ask
    prelude = f"import sys; sys.path.append({str(fallback)!r})\n" if fallback else ""
    r = subprocess.run([sys.executable, "-c", prelude + GEN], env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"building the JIT specs failed:\n{r.stderr[-3000:]}")
    gen = json.loads(r.stdout.split("@@", 1)[1])
    for spec in gen["specs"].values():
        spec["ninja_text"] = Path(spec["ninja"]).read_text()
    return gen


def include_closure(data: Path, gen: dict) -> set[Path]:
    """The specs' sources and the csrc files read under ``data``, and what they reach by ``#include``."""
    dirs, seeds = [data / d for d in INCLUDE_DIRS], [Path(p) for p in gen["opened"]]
    seeds += [Path(s) for spec in gen["specs"].values() for s in spec["sources"]]
    todo = [(p.parent, p.read_text(errors="replace")) for p in seeds]
    seen = {p.resolve() for p in seeds}  # (cascade's sources are csrc files, never copied or read)
    while todo:
        here, text = todo.pop()
        for kind, name in INC.findall(text):
            for cand in ([here / name] if kind == '"' else []) + [d / name for d in dirs]:
                if cand.is_file():
                    cand = cand.resolve()
                    if cand not in seen:
                        seen.add(cand)
                        todo.append((cand.parent, cand.read_text(errors="replace")))
                    break
    return {p for p in seen if data.resolve() in p.parents}


def build(a: argparse.Namespace) -> tuple[Path, dict]:
    work, wheels = a.work, download(a.work)
    if not ((local := work / "local") / "tvm_ffi").exists():  # this interpreter's tvm-ffi, for the specs
        tvm = next(wheels.glob("apache_tvm_ffi-*.whl")).name.split("-")[1]
        pip("install", "--no-deps", "--target", str(local), f"apache-tvm-ffi=={tvm}", "nvidia-ml-py")
    full, stage = work / "full", work / "stage"
    _ = [shutil.rmtree(d, ignore_errors=True) for d in (full, stage)]
    with zipfile.ZipFile(a.wheel) as z:
        z.extractall(full)
    (full / "flashinfer" / "__init__.py").write_text(INIT)  # the wheel's own imports every subpackage
    n_py = python_tree(full, stage / "site")
    gen = generate(full, local, None, work / "ws")
    data, dest = (full / "flashinfer" / "data").resolve(), stage / "site" / "flashinfer" / "data"
    files = {Path(p) for p in gen["opened"]} | include_closure(data, gen)
    for tree in CCCL_TREES:
        files |= {p.resolve() for p in (data / tree).rglob("*") if p.is_file()}
    for p in sorted(files):
        rel = p.relative_to(data)
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, dest / rel)
    deps = {}
    for whl in sorted(wheels.glob("*.whl")):
        name = whl.name.split("-")[0].lower().replace("_", "-")
        where = "site" if any(name == re.split(r"[<>=]", d)[0] for d in SITE_DEPS) else "fallback"
        unzip(whl, stage / where)
        deps[whl.name] = where
    manifest = {"wheel": a.wheel.name, "deny": DENY, "python_files": n_py, "data_files": len(files),
                "deps": deps, "specs": {k: [Path(s).name for s in v["sources"]] for k, v in gen["specs"].items()},
                "modules_imported": len(gen["modules"])}  # fmt: skip
    (stage / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(a.out, "w:gz", compresslevel=9) as tar:
        for part in ("MANIFEST.json", "site", "fallback"):
            tar.add(stage / part, arcname=part)
    sizes = {part: sum(p.stat().st_size for p in (stage / part).rglob("*") if p.is_file())
             for part in ("site/flashinfer/data", "site", "fallback")}  # fmt: skip
    print(f"{a.out}: {a.out.stat().st_size / 2**20:.2f} MiB compressed; unpacked: "
          + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sizes.items())
          + f"; {n_py} package files, {len(files)} data files, {len(deps)} dependency wheels")  # fmt: skip
    return local, gen


def ninja_vars(text: str) -> dict[str, str]:
    text = text.replace("$\n", " ")
    raw = dict(re.findall(r"^(\w+) = (.*)$", text, re.M))
    sub = lambda v: re.sub(r"\$(\w+)", lambda m: raw.get(m.group(1), ""), v)
    return {k: sub(sub(v)) for k, v in raw.items()}  # cuda_cflags -> $common_cflags -> $cuda_home


def preprocess(full: Path, gen: dict, cuda: Path) -> list[str]:
    """``gcc -M`` of every source with its module's flags (device pass with sm_90a's macros, then host); a
    header missing from both trees is the toolkit's (stubbed empty), one only the full tree has a failure."""
    problems, stubs = [], Path(tempfile.mkdtemp())
    ver = int(re.findall(r"#define CUDA_VERSION (\d+)", (cuda / "include" / "cuda.h").read_text())[0])
    base = ["-E", "-M", "-x", "c++", "-D__CUDACC__", "-D__NVCC__", "-D__CUDA_ARCH_LIST__=900",
            f"-D__CUDACC_VER_MAJOR__={ver // 1000}", f"-D__CUDACC_VER_MINOR__={ver % 1000 // 10}", f"-I{cuda}/include",
            "-isystem", f"{cuda}/include/cccl", "-include", "cuda_runtime.h", "-m64"]  # fmt: skip
    device = ["-D__CUDA_ARCH__=900", "-D__CUDA_ARCH_FEAT_SM90_ALL", "-D__CUDA_ARCH_SPECIFIC__=900"]
    for spec in gen["specs"].values():
        flags = shlex.split(ninja_vars(spec["ninja_text"])["cuda_cflags"])
        keep, it = [], iter(flags)
        for f in it:
            keep += [f, next(it)] if f == "-isystem" else [f] if f.startswith(("-I", "-D", "-std")) else []
        for src in spec["sources"]:
            for extra in (device, []):
                for _ in range(20):
                    cmd = ["gcc", *extra, *base, *keep, "-isystem", str(stubs), src]
                    r = subprocess.run(cmd, capture_output=True, text=True)
                    missing = re.findall(r"fatal error: (\S+): No such file", r.stderr)
                    if r.returncode == 0 or not missing:
                        break
                    lost = [
                        d for d in INCLUDE_DIRS if (full / "flashinfer" / "data" / d / missing[0]).is_file()
                    ]
                    if lost or Path(missing[0]).is_absolute():  # a source or a header the slim tree lacks
                        problems.append(f"{Path(src).name}: the slim tree lacks {missing[0]}")
                        break
                    (stubs / missing[0]).parent.mkdir(parents=True, exist_ok=True)
                    (stubs / missing[0]).write_text("")
                if r.returncode and not missing:
                    problems.append(f"{Path(src).name}: {r.stderr.strip()[-300:]}")
    print(
        f"preprocessed {sum(len(s['sources']) for s in gen['specs'].values())} sources x 2 passes; "
        f"toolkit headers absent here, stubbed: {sorted(p.name for p in stubs.rglob('*') if p.is_file())}"
    )
    return problems


def check(a: argparse.Namespace, local: Path) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(a.out) as tar:
            tar.extractall(tmp, filter="data")
        site = Path(tmp) / "site"
        gen = generate(site, local, Path(tmp) / "fallback", Path(tmp) / "ws")
        print(f"import flashinfer from the tarball: {len(gen['modules'])} flashinfer modules imported")
        for key, spec in gen["specs"].items():
            print(f"- {key} ({spec['name'][:60]}...): {[Path(s).name for s in spec['sources']]}")
        v = ninja_vars(gen["specs"]["prefill_fa3_sm90"]["ninja_text"])
        first = gen["specs"]["prefill_fa3_sm90"]["sources"][0]
        print(f"nvcc command for {Path(first).name}:\n  {v['nvcc']} {v['cuda_cflags']} -c {first}")
        cuda = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
        if not (shutil.which("gcc") and (cuda / "include" / "cuda.h").is_file()):
            print("no gcc or CUDA headers here: the preprocessor pass was skipped")
            return 0
        problems = preprocess(a.work / "full", gen, cuda)
    print("\n".join(problems) if problems else "every include resolves inside the slim tree")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", type=Path, required=True, help="flashinfer_python-*.whl")
    ap.add_argument("--out", type=Path, default=Path(".whl/flashinfer_slim.tgz"))
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "flashinfer_carry")
    ap.add_argument("--check", action="store_true", help="import and preprocess from the built tarball")
    a = ap.parse_args(argv)
    local, _ = build(a)
    return check(a, local) if a.check else 0


if __name__ == "__main__":
    raise SystemExit(main())
