"""quillctl's data commands: info, stats, ping, put, get, rm, pin, unpin, ls.

Thin: each command opens one connection, sends one request (ls pages with LIST), prints a
human table or, with --json, one JSON document, and exits with a named code
(quillcache_cli/exitcodes.py).  The work is in quillcache.client.

KEYFIELDS, how a key is named on the command line (the help of every key command says it):
the identity scope comes from options with environment defaults, the block from options:

    --model M        (env QUILLCACHE_MODEL; required)
    --tokenizer T    (env QUILLCACHE_TOKENIZER; default: the model id)
    --adapter A      (env QUILLCACHE_ADAPTER; default: none, the base model)
    --tenant N       (env QUILLCACHE_TENANT; default: the tenant the node bound the token to)
    --prefix-hash P, --block-hash B     (required)
    --index I        (default 0)        --tokens N (default 64)

or, instead of all of them, --key HEX: the encoded key as `ls --json` prints it.  Options
rather than one "a/b/c" string because model ids contain "/" (org/model) and base64 hashes
contain "/" and "+": every field is taken verbatim, nothing needs escaping.
"""
import json
import os
import stat
import sys
import time
from contextlib import contextmanager

import click

from quillcache.net import DEFAULT_ADDRESS
from quillcache.errors import (
    Busy, CapacityError, ConnectionLost, InvalidArgument, NotFound, PermissionDenied,
    ProtocolError, QuillCacheError, ReadOnlyError, Timeout, UnsafeReuse,
)
from quillcache.model import (
    DEFAULT_TOKENS_PER_BLOCK, MAX_BLOCK_INDEX, MAX_PIN_TTL_S, MAX_TOKEN_COUNT, IdentityScope, KeyError_,
    KvBlockKey, decode_key, encode_key, encode_scope, encode_scope_prefix,
)

from quillcache_cli import exitcodes
from quillcache_cli.params import cli_duration

MAX_INPUT_BYTES = 1 << 30     # bytes: largest block `put` reads (the node's max_payload default)
READ_CHUNK = 1 << 20          # bytes: stdin is read in chunks of this size


# --------------------------------------------------------------------------- plumbing

def fail(code: int, message: str):
    click.echo(f"quillctl: {message}", err=True)
    sys.exit(code)


def _want_json(ctx, flag: bool) -> bool:
    return flag or bool((ctx.find_root().obj or {}).get("json"))


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")

# Exceptions the node raises (same class the server reports) -> exit code.  Order matters:
# the first match wins (Timeout is a TimeoutError, ConnectionLost a ConnectionError).
_ERROR_CODES = (
    (NotFound, exitcodes.NOT_FOUND),
    (UnsafeReuse, exitcodes.UNSAFE_REUSE),
    (PermissionDenied, exitcodes.PERMISSION),
    (CapacityError, exitcodes.CAPACITY),
    (Timeout, exitcodes.TEMPFAIL),
    (TimeoutError, exitcodes.TEMPFAIL),
    (ConnectionLost, exitcodes.UNAVAILABLE),
    (ProtocolError, exitcodes.SOFTWARE),
    (InvalidArgument, exitcodes.FAILURE),
    (Busy, exitcodes.FAILURE),
    (ReadOnlyError, exitcodes.FAILURE),
    (QuillCacheError, exitcodes.FAILURE),
)


def exit_code_for(exc: BaseException) -> int:
    for cls, code in _ERROR_CODES:
        if isinstance(exc, cls):
            return code
    if isinstance(exc, (ConnectionError, OSError)):
        return exitcodes.UNAVAILABLE
    return exitcodes.SOFTWARE


@contextmanager
def node(ctx):
    """One connection to the node, with every failure turned into a message and an exit code."""
    from quillcache.client import Client  # import cost only for data commands

    obj = ctx.find_root().obj or {}
    addr = obj.get("addr", DEFAULT_ADDRESS)
    try:
        client = Client(addr, token=obj.get("token"), timeout=obj.get("timeout", 10.0),
                        client_name="quillctl")
    except ConnectionLost as exc:
        fail(exitcodes.UNAVAILABLE, f"{exc} (is quillcached running there?)")
    except (TimeoutError, Timeout):
        fail(exitcodes.TEMPFAIL, f"cannot connect to {addr}: timed out")
    except PermissionDenied as exc:
        if obj.get("token") is None:
            fail(exitcodes.PERMISSION, f"{addr} has tenants and needs a token (--token or QUILLCACHE_TOKEN): {exc}")
        fail(exitcodes.PERMISSION, f"{addr} refused the token: {exc}")
    except QuillCacheError as exc:
        fail(exit_code_for(exc), f"{addr}: {exc}")
    except OSError as exc:
        fail(exitcodes.UNAVAILABLE, f"cannot connect to {addr}: {_reason(exc)}")
    try:
        yield client
    except (QuillCacheError, OSError) as exc:
        code = exit_code_for(exc)
        if code == exitcodes.UNAVAILABLE:
            fail(code, f"lost the connection to {addr}: {_reason(exc)}")
        fail(code, f"{addr}: {_reason(exc)}")
    finally:
        try:
            client.close()
        except (QuillCacheError, OSError):
            pass


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


# --------------------------------------------------------------------------- KEYFIELDS

KEYFIELDS_HELP = """
KEYFIELDS name the key: --model (env QUILLCACHE_MODEL), --tokenizer (env QUILLCACHE_TOKENIZER,
default the model), --adapter (env QUILLCACHE_ADAPTER, default none), --tenant (env
QUILLCACHE_TENANT, default the token's tenant), --prefix-hash, --block-hash, --index (default 0),
--tokens (default 64); every field is taken verbatim (model ids may contain "/").  Or --key HEX,
the encoded key that `ls --json` prints.
"""


KEY_METAVAR = "KEYFIELDS [OPTIONS]"


def scope_options(func):
    func = click.option("--tenant", envvar="QUILLCACHE_TENANT", default=None, metavar="ID",
                        help="Tenant id (env QUILLCACHE_TENANT; default: the tenant the node binds "
                             "the token to).")(func)
    func = click.option("--adapter", envvar="QUILLCACHE_ADAPTER", default=None, metavar="ID",
                        help="LoRA adapter id (env QUILLCACHE_ADAPTER; default: none, the base model).")(func)
    func = click.option("--tokenizer", envvar="QUILLCACHE_TOKENIZER", default=None, metavar="ID",
                        help="Tokenizer id (env QUILLCACHE_TOKENIZER; default: the model id).")(func)
    func = click.option("--model", "-m", envvar="QUILLCACHE_MODEL", default=None, metavar="ID",
                        help="Model id (env QUILLCACHE_MODEL).")(func)
    return func


def key_options(func):
    func = click.option("--key", "key_hex", default=None, metavar="HEX",
                        help="The whole key as hex (what `ls --json` prints), instead of the fields.")(func)
    func = click.option("--tokens", type=click.IntRange(0, MAX_TOKEN_COUNT),
                        default=DEFAULT_TOKENS_PER_BLOCK, show_default=True,
                        help="Tokens in the block (part of the key).")(func)
    func = click.option("--index", "-i", "block_index", type=click.IntRange(0, MAX_BLOCK_INDEX),
                        default=0, show_default=True, help="Position of the block in its prefix chain.")(func)
    func = click.option("--block-hash", "-b", default=None, metavar="HASH",
                        help="Hash of the block's tokens.")(func)
    func = click.option("--prefix-hash", "-p", default=None, metavar="HASH",
                        help="Hash of the prefix the block extends.")(func)
    return scope_options(func)


def _tenant_of(client) -> str:
    tenant = getattr(client, "tenant", None) or getattr(client, "tenant_id", None)
    return tenant if isinstance(tenant, str) and tenant else "default"


def build_scope(client, model, tokenizer, adapter, tenant) -> IdentityScope:
    if not model:
        raise click.UsageError("name the model: --model ID (or set QUILLCACHE_MODEL)")
    scope = IdentityScope(model, tokenizer or model, adapter or None, tenant or _tenant_of(client))
    try:
        encode_scope(scope)        # checks the field limits
    except KeyError_ as exc:
        raise click.UsageError(str(exc)) from None
    return scope


def build_key(client, kw) -> KvBlockKey:
    """The key named by the KEYFIELDS options in ``kw`` (consumed)."""
    key_hex = kw.pop("key_hex")
    fields = {name: kw.pop(name) for name in ("model", "tokenizer", "adapter", "tenant",
                                               "prefix_hash", "block_hash", "block_index", "tokens")}
    if key_hex is not None:
        named = [f"--{n.replace('_', '-')}" for n in ("model", "tokenizer", "adapter", "tenant",
                                                       "prefix_hash", "block_hash")
                 if fields[n] is not None and not _from_env(n)]
        if named:
            raise click.UsageError(f"--key names the whole key: drop {', '.join(named)}")
        try:
            raw = bytes.fromhex(key_hex)
        except ValueError:
            raise click.UsageError(f"--key {key_hex!r}: not hex; give the \"key\" field that `quillctl ls --json` "
                                   "prints (an even number of 0-9 a-f digits)") from None
        try:
            return decode_key(raw)
        except ValueError as exc:
            raise click.UsageError(f"--key {key_hex[:32]!r}{'...' if len(key_hex) > 32 else ''}: not an "
                                   f"encoded key ({exc}); give the \"key\" field that `quillctl ls --json` "
                                   "prints") from None
    missing = [f"--{n.replace('_', '-')}" for n in ("prefix_hash", "block_hash") if fields[n] is None]
    if missing:
        raise click.UsageError(f"name the block: {' and '.join(missing)} (or --key HEX)")
    scope = build_scope(client, fields["model"], fields["tokenizer"], fields["adapter"], fields["tenant"])
    try:
        return KvBlockKey(scope.model_id, scope.tokenizer_id, scope.adapter_id, scope.tenant_id,
                          fields["prefix_hash"], fields["block_hash"], fields["block_index"],
                          fields["tokens"])
    except KeyError_ as exc:
        raise click.UsageError(str(exc)) from None


def _from_env(field: str) -> bool:
    ctx = click.get_current_context()
    src = ctx.get_parameter_source(field)
    return src is not None and src.name == "ENVIRONMENT"


def key_json(key: KvBlockKey) -> dict:
    return {"tenant": key.tenant_id, "model": key.model_id, "tokenizer": key.tokenizer_id,
            "adapter": key.adapter_id, "prefix_hash": key.prefix_hash, "block_hash": key.block_hash,
            "index": key.block_index, "tokens": key.token_count, "key": encode_key(key).hex()}


def key_text(key: KvBlockKey) -> str:
    adapter = f" adapter={key.adapter_id}" if key.adapter_id is not None else ""
    return (f"tenant={key.tenant_id} model={key.model_id} tokenizer={key.tokenizer_id}{adapter} "
            f"prefix={key.prefix_hash} block={key.block_hash} index={key.block_index} "
            f"tokens={key.token_count}")


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join(lines)


# --------------------------------------------------------------------------- info, stats, ping

@click.command("info")
@click.argument("section", required=False, default="")
@json_option
@click.pass_context
def info_cmd(ctx, section, as_json):
    """Print the node's INFO: "# Section" headers and "key:value" lines, as the node sends
    them (SECTION: only that section).  --json asks the node for its JSON form."""
    with node(ctx) as client:
        if _want_json(ctx, as_json):
            click.echo(json.dumps(client.stats(section), indent=2))
        else:
            # the node's own text, verbatim but for its CRLF line ends
            click.echo(client.info_text(section).replace("\r\n", "\n"), nl=False)


@click.command("stats")
@click.argument("section", required=False, default="")
@json_option
@click.pass_context
def stats_cmd(ctx, section, as_json):
    """Print the node's counters as a table (SECTION: only that section)."""
    with node(ctx) as client:
        data = client.stats(section)
    if _want_json(ctx, as_json):
        click.echo(json.dumps(data, indent=2))
        return
    rows = []

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            rows.append([prefix, json.dumps(value) if isinstance(value, (list, bool)) or value is None
                         else str(value)])

    walk("", data)
    click.echo(table(rows, ["STAT", "VALUE"]))


@click.command("ping")
@json_option
@click.pass_context
def ping_cmd(ctx, as_json):
    """Check that the node answers; print the round-trip time."""
    with node(ctx) as client:
        t0 = time.perf_counter()
        client.ping()
        rtt_ms = (time.perf_counter() - t0) * 1e3
    if _want_json(ctx, as_json):
        click.echo(json.dumps({"ok": True, "rtt_ms": round(rtt_ms, 3)}))
    else:
        click.echo(f"PONG {rtt_ms:.3f} ms")


# --------------------------------------------------------------------------- put, get, rm

def _read_input(file: str, limit: int) -> bytes:
    """FILE ('-' = stdin) as bytes, refusing more than ``limit`` bytes before reading them."""
    if file == "-":
        stream = sys.stdin.buffer
        chunks, total = [], 0
        while True:
            chunk = stream.read(min(READ_CHUNK, limit + 1 - total))
            if not chunk:
                break
            total += len(chunk)
            if total > limit:
                fail(exitcodes.USAGE, f"standard input has more than {limit} bytes (the largest block)")
            chunks.append(chunk)
        return b"".join(chunks)
    try:
        with open(file, "rb") as f:
            st = os.fstat(f.fileno())
            if stat.S_ISREG(st.st_mode) and st.st_size > limit:
                fail(exitcodes.USAGE, f"{file} is {st.st_size} bytes: more than {limit} (the largest block)")
            data = f.read(limit + 1)
    except FileNotFoundError:
        fail(exitcodes.IOERR, f"cannot read {file}: no such file; put stores the bytes of an existing "
                              f"file: create it first (e.g. `head -c 1M /dev/urandom > {file}`) or give - "
                              "and pipe the bytes in")
    except OSError as exc:
        fail(exitcodes.IOERR, f"cannot read {file}: {exc.strerror or exc}")
    if len(data) > limit:
        fail(exitcodes.USAGE, f"{file} has more than {limit} bytes (the largest block)")
    return data


def _max_block(client) -> int:
    limits = getattr(client, "limits", None)
    node_max = getattr(limits, "max_payload_bytes", None)
    return min(MAX_INPUT_BYTES, node_max) if isinstance(node_max, int) and node_max > 0 else MAX_INPUT_BYTES


@click.command("put", epilog=KEYFIELDS_HELP, options_metavar=KEY_METAVAR)
@key_options
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--durable", is_flag=True, help="Reply only once the block is on the SSD tier and its "
                                              "WAL record is fsynced.")
@json_option
@click.pass_context
def put_cmd(ctx, file, durable, as_json, **kw):
    """Store the bytes of FILE ('-' for standard input) under the key KEYFIELDS."""
    with node(ctx) as client:
        key = build_key(client, kw)
        data = _read_input(file, _max_block(client))
        if not data:
            fail(exitcodes.USAGE, f"{'standard input' if file == '-' else file} is empty: "
                                  f"a block has at least one byte")
        client.put(key, data, durable=durable)
    if _want_json(ctx, as_json):
        click.echo(json.dumps({"stored": len(data), "durable": durable, **key_json(key)}))
    else:
        click.echo(f"stored {len(data)} bytes{' (durable)' if durable else ''}", err=True)


@click.command("get", epilog=KEYFIELDS_HELP, options_metavar=KEY_METAVAR)
@key_options
@click.option("-o", "--output", type=click.Path(dir_okay=False, allow_dash=True), default=None,
              help="Write the block to this file ('-': standard output, the default).")
@click.pass_context
def get_cmd(ctx, output, **kw):
    """Fetch the block KEYFIELDS; write its bytes to -o FILE or standard output.

    Exits 3 when the key is not there (or not visible to this tenant)."""
    if output in (None, "-") and sys.stdout.isatty():
        fail(exitcodes.USAGE, "refusing to write a binary block to a terminal: use -o FILE or a pipe")
    with node(ctx) as client:
        key = build_key(client, kw)
        data = client.get(key)
    if output in (None, "-"):
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return
    tmp = f"{output}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, output)   # whole or nothing: a reader never sees half a block
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        fail(exitcodes.IOERR, f"cannot write {output}: {exc.strerror or exc}")


@click.command("rm", epilog=KEYFIELDS_HELP, options_metavar=KEY_METAVAR)
@key_options
@json_option
@click.pass_context
def rm_cmd(ctx, as_json, **kw):
    """Remove the block KEYFIELDS.  Exits 3 when it was not there."""
    with node(ctx) as client:
        key = build_key(client, kw)
        removed = client.remove(key)
    _report_flag(ctx, as_json, "removed", removed, key)


# --------------------------------------------------------------------------- pin, unpin

_PIN_DAYS = f"{MAX_PIN_TTL_S / 86400:g} days"     # the store's limit, in words


def _ttl(value):
    seconds = cli_duration(value)
    if not 0 < seconds <= MAX_PIN_TTL_S:
        raise click.BadParameter(f"must be more than 0 and at most {_PIN_DAYS} (e.g. 60s, 10m, 2h)")
    return seconds


@click.command("pin", epilog=KEYFIELDS_HELP, options_metavar=KEY_METAVAR)
@key_options
@click.option("--ttl", required=True, callback=lambda _c, _p, v: _ttl(v), metavar="DURATION",
              help=f"How long the pin lasts, e.g. 60s, 10m, 2h (at most {_PIN_DAYS}).")
@click.option("--hard", is_flag=True, help="Never evict while pinned (default: soft, evicted last).")
@json_option
@click.pass_context
def pin_cmd(ctx, ttl, hard, as_json, **kw):
    """Pin the block KEYFIELDS against eviction for --ttl.  Exits 3 when it is not there."""
    with node(ctx) as client:
        key = build_key(client, kw)
        pinned = client.pin(key, ttl, hard=hard)
    _report_flag(ctx, as_json, "pinned", pinned, key, ttl_s=ttl, hard=hard)


@click.command("unpin", epilog=KEYFIELDS_HELP, options_metavar=KEY_METAVAR)
@key_options
@json_option
@click.pass_context
def unpin_cmd(ctx, as_json, **kw):
    """Drop the pin of the block KEYFIELDS.  Exits 3 when it is not there or not pinned."""
    with node(ctx) as client:
        key = build_key(client, kw)
        done = client.unpin(key)
    _report_flag(ctx, as_json, "unpinned", done, key)


def _report_flag(ctx, as_json, what, ok, key, **extra):
    if _want_json(ctx, as_json):
        click.echo(json.dumps({what: bool(ok), **extra, **key_json(key)}))
    elif ok:
        click.echo(what, err=True)
    else:
        click.echo(f"quillctl: not {what}: no such block", err=True)
    if not ok:
        sys.exit(exitcodes.NOT_FOUND)


# --------------------------------------------------------------------------- ls

@click.command("ls")
@scope_options
@click.option("--prefix-hash", "-p", required=True, metavar="HASH",
              help="The prefix hash whose blocks are listed.")
@click.option("--pool", is_flag=True,
              help="List what the whole pool holds (every member of this node's cluster view), with "
                   "the nodes holding each block; without it, this node's own blocks only.")
@json_option
@click.pass_context
def ls_cmd(ctx, model, tokenizer, adapter, tenant, prefix_hash, pool, as_json):
    """List the blocks of one identity scope (--model, --tokenizer, --adapter, --tenant, with
    the same environment defaults as KEYFIELDS) and one --prefix-hash, in key order: a prefix
    scan on the node (--pool: on every member of its pool).  --json prints each key's fields
    and its hex form (for --key)."""
    holders: dict = {}
    note = ""
    with node(ctx) as client:
        scope = build_scope(client, model, tokenizer, adapter, tenant)
        try:
            encode_scope_prefix(scope, prefix_hash)
        except KeyError_ as exc:
            raise click.UsageError(str(exc)) from None
        if pool:
            keys, holders, note = _pool_ls(ctx, client, scope, prefix_hash)
        else:
            keys = client.ls(scope, prefix_hash)
    if _want_json(ctx, as_json):
        doc = [{**key_json(k), **({"holders": holders[k]} if pool else {})} for k in keys]
        click.echo(json.dumps({"keys": doc, **({"note": note} if note else {})}, indent=2))
        return
    adapter_text = scope.adapter_id if scope.adapter_id is not None else "(none)"
    where = " in the pool" if pool else ""
    click.echo(f"# tenant={scope.tenant_id} model={scope.model_id} tokenizer={scope.tokenizer_id} "
               f"adapter={adapter_text} prefix={prefix_hash}: {len(keys)} key(s){where}")
    if note:
        click.echo(f"# {note}")
    if keys:
        rows = [[k.block_index, k.block_hash, k.token_count] + ([",".join(holders[k])] if pool else [])
                for k in keys]
        click.echo(table(rows, ["INDEX", "BLOCK_HASH", "TOKENS"] + (["HOLDERS"] if pool else [])))


def _pool_ls(ctx, client, scope, prefix_hash):
    """(keys in key order, key -> the ids of the nodes holding it, a note): a LIST on every
    member that this node's cluster view shows up (one connection each, the same token)."""
    from quillcache.client import Client
    from quillcache.protocol import cluster as wire
    from quillcache.protocol.opcodes import Opcode

    try:
        view = wire.decode_json(client.call(Opcode.CLUSTER_VIEW).header)
    except QuillCacheError as exc:
        here = client.ls(scope, prefix_hash)
        return here, {k: ["(this node)"] for k in here}, f"this node is not in a pool ({exc}): its own blocks"
    obj = ctx.find_root().obj or {}
    holders: dict = {}
    missed = []
    for m in view["members"]:
        if m["state"] != "up":
            continue
        try:
            if m["self"]:
                found = client.ls(scope, prefix_hash)
            else:
                with Client(m["address"], token=obj.get("token"), timeout=obj.get("timeout", 10.0),
                            client_name="quillctl") as other:
                    found = other.ls(scope, prefix_hash)
        except (QuillCacheError, OSError) as exc:
            missed.append(f"{m['node_id']} ({_reason(exc)})")
            continue
        for k in found:
            holders.setdefault(k, []).append(m["node_id"])
    keys = sorted(holders, key=encode_key)
    return keys, holders, f"not listed: {', '.join(missed)}" if missed else ""


DATA_COMMANDS = (info_cmd, stats_cmd, ping_cmd, put_cmd, get_cmd, rm_cmd, pin_cmd, unpin_cmd, ls_cmd)
