"""`laswrr proxy`: run one OpenAI-compatible proxy replica.

Listens on 127.0.0.1 unless --host says otherwise (0.0.0.0: every interface). Prints ``proxy
listening on http://HOST:PORT`` as its first stdout line (flushed, so a parent can read the port
chosen for --port 0; bound to every interface, the URL is loopback's and the line says so), then serves until SIGINT/SIGTERM: the listening socket
closes at once, in-flight requests get --grace-s to finish, events are flushed,
``lb.proxy.stopped.<proxy-id>`` is published, and the process exits 0. Several replicas may run
side by side (distinct --proxy-id; --reuse-port lets them share one port). --workers N runs N
such processes on one port under a supervising parent, worker k with the proxy id
<proxy-id>-<k> (services/proxy/workers.py); with --admin-port P, worker k serves /metrics and the
probes on P+k.
Runnable without the dispatcher too: ``python -m laswrr.services.proxy.cli``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from laswrr.services.proxy.app import start
from laswrr.services import settings
from laswrr.services.proxy.keys import keys_file_problem
from laswrr.services.proxy.config import SAME, ProxyConfig, Setting, default_proxy_id, flag_of, parser_of, settings_of

LISTEN_PREFIX = "proxy listening on "
GC_GEN0_THRESHOLD = 10_000  # CPython's 700 runs a young collection every few requests


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` as an argparse type: its ValueError is the usage error's text."""
    if getattr(parse, "__name__", "").startswith("duration_"):
        return parse  # already an argparse type (services/settings.py)

    def checked(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    checked.__name__ = getattr(parse, "__name__", "value")
    return checked


def default_text(value: Any, how: Setting) -> str:
    """A setting's default as --help and the docs say it."""
    if how.default_text is not None:
        return how.default_text
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or value == ():
        return "none"
    return str(value)


def add_setting(parser: Any, field: dataclasses.Field[Any], how: Setting, flag: str, default: Any, shown: Any,
                **more: Any) -> argparse.Action:
    """One flag of a declared setting on ``parser`` (an ArgumentParser or a group of one); its help
    says ``shown`` is the default (``default`` may differ: None for "not given")."""
    if how.env:
        default = os.environ.get(how.env) or default
    text = f"{how.help} (default {default_text(shown, how)})".replace("%", "%%")
    if field.type == "bool":
        action = argparse.BooleanOptionalAction if how.negatable else "store_true"
        return parser.add_argument(flag, action=action, default=default, help=text, **more)
    return parser.add_argument(flag, type=_argparse_type(parser_of(field, how)), default=default,
                               metavar=how.metavar, choices=list(how.choices) or None, help=text, **more)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag of ``laswrr proxy``: one per declared setting (config.py), then --loop and logging."""
    settings.add_nats_options(parser)
    settings.add_stream_replicas(parser, default=ProxyConfig.__dataclass_fields__["stream_replicas"].default)
    groups: dict[str, Any] = {"": parser}
    for field, how in settings_of():
        flag = flag_of(field, how)
        if flag is None or how.shared:
            continue
        if how.group not in groups:
            groups[how.group] = parser.add_argument_group(how.group)
        default = field.default if how.cli_default is SAME else how.cli_default
        add_setting(groups[how.group], field, how, flag, default, field.default, dest=field.name)
    parser.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"],
                        help="event loop; auto = uvloop when installed (default %(default)s)")
    settings.add_logging(parser)


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("proxy", help="run an OpenAI-compatible LA-SWRR proxy replica",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run_proxy)


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    """The config of the parsed flags: every declared setting with a flag, by its name."""
    values = {field.name: getattr(args, field.name) for field, how in settings_of() if flag_of(field, how)}
    values["proxy_id"] = values["proxy_id"] or default_proxy_id()
    return ProxyConfig(**values, nats_auth=settings.nats_auth(args)).validate()


# -- the proxy's settings given to `laswrr up` ------------------------------------------------------


def add_up_arguments(parser: argparse.ArgumentParser) -> None:
    """``laswrr up``'s own flags for the settings declared with ``up=`` (--proxy-host, --flow-control,
    ...); each defaults to None ("not given": ``up_settings`` resolves it) and its help says the
    default ``up`` applies."""
    for field, how in settings_of():
        if how.up:
            add_setting(parser, field, how, how.up, None, field.default if how.up_default is SAME else how.up_default)


def setting_named(key: str) -> tuple[dataclasses.Field[Any], Setting]:
    """The declared setting called ``key``: its field name (queue_bound) or its flag (--queue-bound)."""
    name = key.strip().removeprefix("--").replace("-", "_")
    for field, how in settings_of():
        flag = flag_of(field, how)
        if flag is not None and not how.shared and name in (field.name, flag.removeprefix("--").replace("-", "_")):
            return field, how
    raise ValueError(f"unknown proxy setting {key!r} (docs/configuration.md lists the settings)")


def setting_value(key: str, value: Any) -> tuple[str, Any]:
    """(field name, value) of ``key`` set to ``value`` (text as typed, or a TOML value)."""
    field, how = setting_named(key)
    if field.type == "bool":
        text = str(value).strip().lower()
        if text not in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            raise ValueError(f"{field.name}: {value!r} is not a switch (true or false)")
        return field.name, text in ("true", "1", "yes", "on")
    text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    try:
        return field.name, parser_of(field, how)(text)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise ValueError(f"{field.name}: {exc}") from None


def up_settings(args: argparse.Namespace, table: dict[str, Any], pairs: Sequence[str]) -> ProxyConfig:
    """The proxy's settings under ``laswrr up``: its defaults (``up_default``), then the config
    file's ``[proxy]`` ``table``, then ``up``'s own flags, then ``--proxy-arg`` ``pairs``
    (KEY=VALUE); ValueError names a bad one. Validated as a proxy would (``ProxyConfig.validate``)."""
    values = {field.name: how.up_default for field, how in settings_of() if how.up and how.up_default is not SAME}
    values.update(setting_value(key, value) for key, value in table.items())
    if "proxy_id" in values:
        raise ValueError("proxy_id: laswrr up names its proxies itself (proxy, proxy-2, ...; workers proxy-0, ...)")
    for field, how in settings_of():
        if how.up and (given := getattr(args, how.up.removeprefix("--").replace("-", "_"), None)) is not None:
            values[field.name] = given
    for pair in pairs:
        key, equals, value = pair.partition("=")
        if not equals:
            raise ValueError(f"--proxy-arg {pair!r}: give KEY=VALUE, e.g. queue_bound=256")
        values.update([setting_value(key, value)])
        if "proxy_id" in values:
            raise ValueError("proxy_id: laswrr up names its proxies itself (proxy, proxy-2, ...; workers proxy-0, ...)")
    return dataclasses.replace(ProxyConfig(), **values).validate()


def proxy_argv(config: ProxyConfig, skip: Sequence[str] = ()) -> list[str]:
    """``laswrr proxy``'s flags for every setting of ``config`` that differs from a bare proxy's
    (``skip``: field names the caller passes itself)."""
    argv = []
    for field, how in settings_of():
        flag, value = flag_of(field, how), getattr(config, field.name)
        if flag is None or how.shared or field.name in skip or value == field.default:
            continue
        if field.type == "bool":
            argv.append(flag if value else f"--no-{flag.removeprefix('--')}")
        else:
            argv.append(f"{flag}={','.join(value) if isinstance(value, tuple) else value}")
    return argv


def parser() -> argparse.ArgumentParser:
    """``laswrr proxy``'s own parser (no environment), e.g. to check another command's proxy flags."""
    parser = argparse.ArgumentParser(prog="laswrr proxy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return parser


async def serve(config: ProxyConfig) -> None:
    stop = settings.stop_event()  # before the banner: a parent may signal right after it
    proxy = await start(config)
    tune_gc()
    print(f"{LISTEN_PREFIX}{proxy.url}{bound_note(config.host)}", flush=True)
    try:
        await stop.wait()
    finally:
        logging.getLogger("laswrr.proxy").info("signal received: stopping gracefully")
        await proxy.stop()


def bound_note(host: str) -> str:
    """What to say after the URL when the proxy listens on every interface (the URL is loopback's)."""
    return f" (bound to {host or '0.0.0.0'}: every interface)" if host in ("0.0.0.0", "", "::") else ""


def tune_gc() -> None:
    """Fewer cyclic-GC passes on the request path (they cost ~5 % of the proxy's CPU at 700).

    Everything alive after start-up (modules, the app) is frozen out of the collector's scans;
    requests free their objects by reference counting, so young collections can be rarer.
    """
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


def run_proxy(args: argparse.Namespace) -> int:
    settings.configure_logging(args, "proxy")
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"proxy: {exc}", file=sys.stderr)
        return 2
    if config.api_keys_file is not None and (problem := keys_file_problem(config.api_keys_file)):
        print(f"proxy: {problem}", file=sys.stderr)
        return 2
    if config.workers > 1:
        if args.loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
            print("proxy: --loop uvloop needs the uvloop package (pip install uvloop)", file=sys.stderr)
            return 2
        from laswrr.services.proxy.workers import run_group

        return run_group(config, args.loop, args.log_level, args.log_format)
    return serve_config(config, args.loop)


def serve_config(config: ProxyConfig, loop: str) -> int:
    """Serve one proxy on ``config`` until SIGINT/SIGTERM; the exit status."""
    try:
        _run(serve(config), loop)
    except ImportError:
        print("proxy: --loop uvloop needs the uvloop package (pip install uvloop)", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"proxy: cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr)
        return 1
    return 0


def _run(main: Coroutine[Any, Any, None], loop: str) -> None:
    """asyncio.run on uvloop when asked (or installed, for ``auto``): it halves the loop's own cost."""
    if loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if loop == "uvloop":
                main.close()
                raise
        else:
            uvloop.run(main)
            return
    asyncio.run(main)


def main(argv: Sequence[str] | None = None) -> int:
    return run_proxy(parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
