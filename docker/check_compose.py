"""Check a compose file without a Docker engine (CI has none): python docker/check_compose.py FILE...

`docker compose config` needs no engine either, but CI machines have no Compose CLI; this check
needs only PyYAML. It reads the file as Compose would (YAML, `<<` merges, `x-` extension
fields) and reports, one line each: unknown top-level or service keys (with a did-you-mean),
a service with neither `image` nor `build`, an image without an explicit tag or on `latest`, a
build context or Dockerfile that does not exist, `depends_on` naming an unknown service or
condition, `service_healthy` on a service without a healthcheck, a named volume that is not
declared, and a `${VAR}` without a default (so a plain `docker compose up` works). Exit status
1 when there is a problem, else 0. tests/test_docker.py imports :func:`check`.
"""

from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path
from typing import Any

import yaml

TOP_KEYS = ("name", "services", "volumes", "networks", "configs", "secrets", "include", "models")
# The Compose Specification's service keys.
SERVICE_KEYS = (
    "annotations",
    "attach",
    "blkio_config",
    "build",
    "cap_add",
    "cap_drop",
    "cgroup",
    "cgroup_parent",
    "command",
    "configs",
    "container_name",
    "cpu_count",
    "cpu_percent",
    "cpu_period",
    "cpu_quota",
    "cpu_rt_period",
    "cpu_rt_runtime",
    "cpu_shares",
    "cpus",
    "cpuset",
    "credential_spec",
    "depends_on",
    "deploy",
    "develop",
    "device_cgroup_rules",
    "devices",
    "dns",
    "dns_opt",
    "dns_search",
    "domainname",
    "entrypoint",
    "env_file",
    "environment",
    "expose",
    "extends",
    "external_links",
    "extra_hosts",
    "gpus",
    "group_add",
    "healthcheck",
    "hostname",
    "image",
    "init",
    "ipc",
    "isolation",
    "label_file",
    "labels",
    "links",
    "logging",
    "mac_address",
    "mem_limit",
    "mem_reservation",
    "mem_swappiness",
    "memswap_limit",
    "models",
    "network_mode",
    "networks",
    "oom_kill_disable",
    "oom_score_adj",
    "pid",
    "pids_limit",
    "platform",
    "ports",
    "post_start",
    "pre_stop",
    "privileged",
    "profiles",
    "provider",
    "pull_policy",
    "read_only",
    "restart",
    "runtime",
    "scale",
    "secrets",
    "security_opt",
    "shm_size",
    "stdin_open",
    "stop_grace_period",
    "stop_signal",
    "storage_opt",
    "sysctls",
    "tmpfs",
    "tty",
    "ulimits",
    "use_api_socket",
    "user",
    "userns_mode",
    "uts",
    "volumes",
    "volumes_from",
    "working_dir",
)
CONDITIONS = ("service_started", "service_healthy", "service_completed_successfully")
_VAR = re.compile(r"\$\{([^}]*)\}")


def load(path: str | Path) -> dict[str, Any]:
    """The compose file at ``path`` as a mapping (``ValueError`` when it is not one)."""
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a YAML mapping")
    return data


def _unknown(keys: Any, valid: tuple[str, ...] | list[str], where: str) -> list[str]:
    out = []
    for key in keys:
        if isinstance(key, str) and key.startswith("x-"):
            continue
        if key not in valid:
            close = difflib.get_close_matches(str(key), list(valid), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            out.append(f"{where}: unknown key {key!r}{hint}")
    return out


def _image_problem(image: object) -> str | None:
    if not isinstance(image, str) or not image:
        return f"image {image!r} is not a string"
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    if ":" not in last:
        return f"image {image!r} has no tag: pin one (e.g. {image}:1.2.3)"
    if last.rsplit(":", 1)[1] == "latest":
        return f"image {image!r} uses 'latest': pin a version tag"
    return None


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def check(path: str | Path) -> list[str]:
    """The problems of the compose file at ``path``; an empty list when there are none."""
    path = Path(path)
    try:
        data = load(path)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        return [f"{path}: {exc}"]
    problems = _unknown(data, TOP_KEYS, "top level")
    services = data.get("services")
    if not isinstance(services, dict) or not services:
        return [*problems, "no services"]
    declared = data.get("volumes") or {}
    for name, svc in services.items():
        where = f"services.{name}"
        if not isinstance(svc, dict):
            problems.append(f"{where}: not a mapping")
            continue
        problems += _unknown(svc, SERVICE_KEYS, where)
        if "image" not in svc and "build" not in svc:
            problems.append(f"{where}: neither image nor build")
        if "image" in svc:
            problem = _image_problem(svc["image"])
            if problem:
                problems.append(f"{where}: {problem}")
        build = svc.get("build")
        if build is not None:
            build = {"context": build} if isinstance(build, str) else build
            context = path.parent / build.get("context", ".")
            dockerfile = context / build.get("dockerfile", "Dockerfile")
            if not context.is_dir():
                problems.append(f"{where}.build: context {context} is not a folder")
            elif not dockerfile.is_file():
                problems.append(f"{where}.build: no Dockerfile at {dockerfile}")
        deps = svc.get("depends_on") or {}
        deps = {key: {} for key in deps} if isinstance(deps, list) else deps
        for dep, spec in deps.items():
            if dep not in services:
                problems.append(f"{where}.depends_on: unknown service {dep!r}")
                continue
            condition = (spec or {}).get("condition", "service_started")
            if condition not in CONDITIONS:
                problems.append(f"{where}.depends_on.{dep}: unknown condition {condition!r}")
            elif condition == "service_healthy" and "healthcheck" not in services[dep]:
                problems.append(
                    f"{where}.depends_on.{dep}: service_healthy, but {dep} has no healthcheck"
                )
        for volume in svc.get("volumes") or []:
            if isinstance(volume, dict):
                source = volume.get("source") if volume.get("type") == "volume" else None
            else:
                parts = str(volume).split(":")
                source = parts[0] if len(parts) > 1 else None  # "/path" alone: anonymous
            if (
                isinstance(source, str)
                and not source.startswith(("/", ".", "~", "$"))
                and source not in declared
            ):
                problems.append(f"{where}.volumes: named volume {source!r} is not declared")
        for text in _strings(svc):
            for var in _VAR.findall(text):
                if "-" not in var and "?" not in var:
                    problems.append(f"{where}: ${{{var}}} has no default (write ${{{var}:-...}})")
    return problems


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    failed = False
    for file in argv:
        problems = check(file)
        for problem in problems:
            print(f"{file}: {problem}", file=sys.stderr)
        if problems:
            failed = True
        else:
            services = ", ".join(load(file)["services"])
            print(f"{file}: ok (services: {services})")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
