"""What the unit templates (templates/ in the repository) are rendered from: the plan and the deploy options.

One function builds the template context for both renderers: the vlserve_deploy role (through
the `vlserve_units_context` filter) and `vlserve render-units` (for hosts without Ansible).
"""

from __future__ import annotations

import pathlib
from typing import Any

CONFIG_DIR = "/etc/vlserve"
UNIT_DIR = "/etc/systemd/system"
# Files rendered from templates/, and where each goes on the host: the one list both renderers (the
# deploy role through `vlserve_units.files`, `render_all` here) write from.
UNIT_FILES = {
    "vlserve@.service.j2": UNIT_DIR + "/vlserve@.service",
    "vlserve.target.j2": UNIT_DIR + "/vlserve.target",
    "vlserve-front.service.j2": UNIT_DIR + "/vlserve-front.service",
}
CONFIG_FILES = {
    "vlserve.env.j2": CONFIG_DIR + "/vlserve.env",
    "haproxy.cfg.j2": CONFIG_DIR + "/haproxy.cfg",
}
# Per plan worker: its environment and its systemd drop-in (CPUs, memory limits).
WORKER_FILES = {
    "worker.env.j2": CONFIG_DIR + "/worker-{index}.env",
    "worker.conf.j2": UNIT_DIR + "/vlserve@{index}.service.d/50-plan.conf",
}
ERROR_PAGE_FILE = CONFIG_DIR + "/errors/{status}.http"
# The front's own error pages: raw HTTP responses in the service's error shape.
ERROR_PAGES = {
    400: ("Bad Request", "the request is malformed", "invalid_request_error", "bad_request"),
    401: (
        "Unauthorized",
        "missing or wrong API key (Authorization: Bearer <key>)",
        "authentication_error",
        "invalid_api_key",
    ),
    413: (
        "Payload Too Large",
        "the request body is over the upload limit",
        "invalid_request_error",
        "request_too_large",
    ),
    503: ("Service Unavailable", "no worker is ready; try again shortly", "service_unavailable", "no_worker_ready"),
    504: ("Gateway Timeout", "the worker did not answer in time", "timeout_error", "timeout"),
}


def units_context(plan: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """The `vlserve_units` variable of the templates.

    `options`: the vlserve_deploy role's variables without their prefix (install_dir, user, group,
    model_dir, state_dir, cache_dir, front_port, front_bind, api_key, settings, ...).
    """
    install_dir = str(options["install_dir"])
    merged = {
        "max_upload_bytes": int(options["max_upload_bytes"]),
        "request_timeout_s": int(options["request_timeout_s"]),
        **options.get("settings", {}),
    }
    settings = {"VLSERVE_%s" % name.upper(): _env_value(value) for name, value in sorted(merged.items())}
    return {
        "model_name": plan["model"]["name"],
        "served_model_name": options["served_model_name"],
        "install_dir": install_dir,
        "venv": install_dir + "/venv",
        "user": options["user"],
        "group": options["group"],
        "config_dir": CONFIG_DIR,
        "files": {"units": UNIT_FILES, "config": CONFIG_FILES, "worker": WORKER_FILES},
        "model_dir": str(options["model_dir"]),
        "state_dir": str(options["state_dir"]),
        "cache_dir": str(options["cache_dir"]),
        "start_timeout_s": int(options["start_timeout_s"]),
        "image_url_hosts": list(options.get("settings", {}).get("image_url_hosts", [])),
        "settings": settings,
        "numa_bind": plan["workers"]["numa_bind"],
        "workers": [
            dict(worker, files={name: path.format(index=worker["index"]) for name, path in WORKER_FILES.items()})
            for worker in plan["worker_list"]
        ],
        "front": {
            "port": int(options["front_port"]),
            "bind": options["front_bind"],
            "api_key": options.get("api_key") or "",
            "max_upload_bytes": int(options["max_upload_bytes"]),
            "timeout_s": int(options["request_timeout_s"]) + 30,
        },
        "error_pages": [
            {
                "status": status,
                "reason": reason,
                "message": message,
                "type": kind,
                "code": code,
                "file": ERROR_PAGE_FILE.format(status=status),
            }
            for status, (reason, message, kind, code) in ERROR_PAGES.items()
        ],
    }


def _env_value(value: Any) -> str:
    """A setting as an EnvironmentFile= value: lists as JSON (what pydantic-settings reads), booleans lowercase."""
    import json  # noqa: PLC0415

    if isinstance(value, (list, dict)):
        return json.dumps(value)
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def comment(text: str) -> str:
    """Ansible's `comment` filter in its default style, for renders without Ansible."""
    return "#\n" + "\n".join(("# " + line).rstrip() for line in text.splitlines()) + "\n#"


def render_all(templates: pathlib.Path, context: dict[str, Any], managed: str) -> dict[str, str]:
    """Every file of the deployment, path -> text, rendered from the templates with Jinja2."""
    import jinja2  # noqa: PLC0415

    from vlserve.sizing import format_cpu_list  # noqa: PLC0415

    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
    )
    environment.filters.update(vlserve_cpu_list=format_cpu_list, comment=comment)
    base = {"vlserve_units": context, "ansible_managed": managed}
    files = {}
    for name, destination in {**UNIT_FILES, **CONFIG_FILES}.items():
        files[destination] = environment.get_template(name).render(base)
    for worker in context["workers"]:
        for name, destination in worker["files"].items():
            files[destination] = environment.get_template(name).render(dict(base, worker=worker))
    for page in context["error_pages"]:
        text = environment.get_template("error.http.j2").render(dict(base, page=page))
        files[page["file"]] = text.replace("\n", "\r\n")
    return files
