"""The `inflight` command line's argument parser: every command, flag and help text
(`worker/__main__.py` dispatches what it parses)."""

from __future__ import annotations

import argparse

from worker.cli.commands import STREAM_TIMEOUT_S
from worker.config.checks import LOG_LEVELS

DEFAULT_KAFKA = "127.0.0.1:19092"  # also INFLIGHT_KAFKA__BOOTSTRAP_SERVERS, read by the config loader
DEFAULT_REDIS = "redis://127.0.0.1:6390/0"  # also INFLIGHT_REDIS__URL


class ShowDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` names every default, except where the help text already says it or
    there is none to name (unset, or a flag that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


def client_args(sp: argparse.ArgumentParser) -> None:
    """The connection flags every client command takes."""
    sp.add_argument("--config", help="YAML file whose `kafka` and `redis` sections give addresses, prefixes and "
                    "connection security (SASL, TLS, client certificates, Redis ACL user); INFLIGHT_KAFKA__* / "
                    "INFLIGHT_REDIS__* env vars override it. submit: its `pools` section and the tokenizer of "
                    "`model.path` route the job to the pool serving its prompt length")
    sp.add_argument("--kafka", default=None, help=f"bootstrap servers (default: the config's, else {DEFAULT_KAFKA})")
    sp.add_argument("--redis", default=None, help=f"Redis URL (default: the config's, else {DEFAULT_REDIS})")
    sp.add_argument("--prefix", default=None, help="topic and key prefix (default: the config's, else inflight)")
    sp.add_argument("--timeout", type=float, default=STREAM_TIMEOUT_S,
                    help="seconds to wait for the job's end (stream, submit --stream); on expiry: a hint, exit 1")


def build_parser() -> argparse.ArgumentParser:
    """The parser of every `inflight` command."""
    p = argparse.ArgumentParser(prog="inflight", description="Inflight LLM serving worker")
    sub = p.add_subparsers(dest="cmd", required=True)
    _servers(sub)
    _client_commands(sub)
    _operator_commands(sub)
    _generate_command(sub)
    return p


def _servers(sub) -> None:
    """worker, gateway, check."""
    w = sub.add_parser("worker", help="run a worker")
    w.add_argument("--config", help="YAML config file; INFLIGHT_<SECTION>__<FIELD> env vars override it")
    w.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=None,
                   help="log level of the worker and its engine core (default: the config's worker.log_level, INFO)")

    gw = sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway (chat / completions, streaming, "
                        "Batch API) in front of the job topics")
    gw.add_argument("--config", help="YAML file with `gateway`, `kafka` and `redis` sections; "
                    "INFLIGHT_<SECTION>__<FIELD> env vars override it")
    gw.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default="INFO")

    ck = sub.add_parser("check", help="preflight a worker config: one line per check with the setting to fix; "
                        "exit 0 only if every check passes")
    ck.add_argument("--config", help="YAML config file; INFLIGHT_<SECTION>__<FIELD> env vars override it")
    ck.add_argument("--timeout", type=float, default=10.0, help="seconds for each Kafka / Redis step")
    ck.add_argument("--json", action="store_true", help="print the checks as a JSON array")


def _client_commands(sub) -> None:
    """submit, stream, cancel."""
    defaults = ShowDefaults
    s = sub.add_parser("submit", formatter_class=defaults,
                       help="produce a job (prints its id; with --stream the id goes to stderr, the text to stdout)",
                       description="Produce a job. --max-tokens and --temperature default to a short greedy answer "
                       "for a terminal; a job without them (the wire schema) gets temperature 1.0 and up to the "
                       "worker's max_output_tokens.")
    client_args(s)
    s.add_argument("--prompt", required=True)
    s.add_argument("--priority", default="normal", choices=["high", "normal", "low"], help="the job's topic")
    s.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    s.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    s.add_argument("--seed", type=int, default=None, help="sampling seed (none: random)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    s.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    s.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats (1: off)")
    s.add_argument("--stop", action="append", default=None, help="a stop string (repeat the flag)")
    s.add_argument("--ignore-eos", action="store_true", help="generate past EOS until --max-tokens (long answers "
                   "to watch or cancel mid-stream)")
    s.add_argument("--job-id", default=None, help="the job's id (none: a random one)")
    s.add_argument("--tenant", default=None, help="the job's tenant: its stream goes to the tenant's Redis keys")
    s.add_argument("--adapter", default=None, help="a LoRA adapter of the workers' model.lora_dir (default: the base model)")
    s.add_argument("--stream", action="store_true", help="stream the tokens to stdout")
    fmt = s.add_argument_group("structured output (params.structured; at most one)").add_mutually_exclusive_group()
    fmt.add_argument("--json-schema", metavar="SCHEMA", default=None,
                     help="the output is JSON valid against this JSON Schema (inline JSON, or @FILE)")
    fmt.add_argument("--json-object", action="store_true", help="the output is one JSON object")
    fmt.add_argument("--regex", default=None, help="the whole output matches this regex")
    fmt.add_argument("--choice", action="append", default=None, help="the output is one of these (repeat the flag)")
    fmt.add_argument("--grammar", metavar="LARK", default=None, help="a Lark grammar (inline, or @FILE)")
    st = sub.add_parser("stream", formatter_class=defaults, help="stream a job's events (replays what already happened; waits for a job "
                        "not seen yet, up to --timeout)")
    client_args(st)
    st.add_argument("job_id")
    st.add_argument("--tenant", default=None, help="the tenant the job was submitted with")
    c = sub.add_parser("cancel", formatter_class=defaults, help="cancel a job")
    client_args(c)
    c.add_argument("job_id")


def _operator_commands(sub) -> None:
    """dlq, jobs audit, job show, topics, schema, acl."""
    defaults = ShowDefaults
    dlq = sub.add_parser("dlq", formatter_class=defaults, help="dead letters: list them by reason, replay chosen ones")
    dsub = dlq.add_subparsers(dest="dlq_cmd", required=True)
    for name, help_ in (("list", "show dead letters (one line each: where, when, reason, job id, source, error) and "
                                 "a count by reason"),
                        ("replay", "re-produce chosen dead letters to their job topics under new job ids "
                                   "(<job_id>.replay-<partition>-<offset>: replaying twice runs once)")):
        d = dsub.add_parser(name, formatter_class=defaults, help=help_, description=help_)
        client_args(d)
        d.add_argument("--reason", action="append", default=None, help="only this reason (repeat the flag)")
        d.add_argument("--job-id", action="append", default=None, help="only this job id (repeat the flag)")
        d.add_argument("--since", default=None, help="only records written since: seconds ago (600), a duration "
                       "(10m, 2h, 1d) or an ISO time")
        d.add_argument("--limit", type=int, default=None, help="at most this many (oldest first)")
        if name == "list":
            d.add_argument("--json", action="store_true", help="one JSON object per line")
        else:
            d.add_argument("--all", action="store_true", help="replay every record the filters select (without a "
                           "filter, --all is required)")
            d.add_argument("--force", action="store_true", help="also send records whose reason can never succeed "
                           "on the same input (invalid_job, invalid_params, ...)")
            d.add_argument("--dry-run", action="store_true", help="say what would be sent, send nothing")

    jobs = sub.add_parser("jobs", formatter_class=defaults, help="check the jobs of a time window")
    jobs_sub = jobs.add_subparsers(dest="jobs_cmd", required=True)
    help_ = ("every job produced in the window: exactly one recorded outcome, its log whole and equal to it "
             "(the fault soak's checks); prints defects by kind, exit 1 if any")
    au = jobs_sub.add_parser("audit", formatter_class=defaults, help=help_, description=help_)
    client_args(au)
    au.add_argument("--since", required=True, help="the window's start: seconds ago (600), a duration (10m, 2h, 1d) "
                    "or an ISO time")
    au.add_argument("--until", default=None, help="the window's end, in the same forms (default: now)")
    au.add_argument("--pending-after", type=float, default=600.0, help="seconds after which a job with no outcome "
                    "is a defect (missing_outcome) rather than pending")
    au.add_argument("--json", action="store_true", help="print the report as JSON")
    job = sub.add_parser("job", formatter_class=defaults, help="inspect one job")
    job_sub = job.add_subparsers(dest="job_cmd", required=True)
    help_ = ("one job: where it was produced, its log (run-length coded), its recorded outcome, its dead letters "
             "and its audit; exit 1 if nothing knows it or it has a defect")
    sh = job_sub.add_parser("show", formatter_class=defaults, help=help_, description=help_)
    client_args(sh)
    sh.add_argument("job_id")
    sh.add_argument("--tenant", default=None, help="the job's tenant (default: read from its record)")
    sh.add_argument("--since", default="1d", help="how far back to look for its record and dead letters")
    sh.add_argument("--json", action="store_true", help="print it as JSON")

    t = sub.add_parser("topics", formatter_class=defaults, help="manage topics")
    t.add_argument("action", choices=["create"])
    t.add_argument("--bootstrap", default=None, help=f"bootstrap servers (default: the config's, else {DEFAULT_KAFKA})")
    t.add_argument("--config", help="YAML file whose `kafka` section gives the connection security (a principal "
                   "allowed to create topics) and whose `pools` section the pools' job topics; INFLIGHT_KAFKA__* env "
                   "vars override it")
    t.add_argument("--prefix", default=None, help="topic prefix (default: the config's, else inflight)")
    t.add_argument("--partitions", type=int, default=6, help="partitions per topic")
    t.add_argument("--replication-factor", type=int, default=1, help="replicas per partition")
    t.add_argument("--quiet", action="store_true")

    sub.add_parser("schema", help="print the JSON Schema of the wire messages")

    acl = sub.add_parser("acl", help="print the ACLs a deployment needs: Kafka's AclCommand (kafka-acls.sh) "
                         "arguments, one line per grant, or a Redis user's ACL rules")
    acl.add_argument("system", choices=["kafka", "redis"])
    acl.add_argument("role", nargs="?", choices=["worker", "gateway", "reader"], help="redis: whose rules")
    acl.add_argument("--prefix", default="inflight", help="topic prefix (kafka) or key prefix (redis)")
    acl.add_argument("--group", default="inflight-workers", help="kafka: the workers' group id")
    acl.add_argument("--config", default=None, help="kafka: take the prefix, group and pools from this worker "
                     "config (every pool's topics and groups; workers may write other pools' job topics)")
    acl.add_argument("--worker-principal", default="User:inflight-worker")
    acl.add_argument("--producer-principal", default="User:inflight-producer")
    acl.add_argument("--no-results-read", action="store_true",
                     help="kafka: do not let the producer principal read the results topic")
    acl.add_argument("--tenant", default=None, help="redis reader: the tenant (none: jobs without a tenant)")
    acl.add_argument("--may-cancel", action="store_true", help="redis reader: may also set cancel tombstones")


def _generate_command(sub) -> None:
    """generate: the engine alone."""
    defaults = ShowDefaults
    g = sub.add_parser("generate", formatter_class=defaults,
                       help="run prompts through the engine in this process and stream the text")
    g.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    g.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens per prompt")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (none: random)")
    g.add_argument("--stop", action="append", help="a stop string (repeat for several)")
    g.add_argument("--priority", default="normal", choices=["high", "normal", "low"], help="the prompts' class")
    g.add_argument("--device", default="auto", help="cpu, cuda or auto")
