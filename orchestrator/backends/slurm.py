"""The Slurm backend: a cluster reached through its login node (a `slurm:` host in hosts.yaml). Slurm
queues, places, limits and accounts the jobs; reval submits, follows, pulls and compares as it does for
SSH hosts. The payload and its venv are synced once to the workdir on the shared filesystem (the login
node's transport); every run is a batch job (one sbatch; several runs = one job array with %K) whose task
runs the payload's wrapper with `--gpus scheduler` (CUDA_VISIBLE_DEVICES is the job's), its output
appended to the run's eval.log. The texts (batch script, parsers, state mapping) are hosts/slurmjobs.py's.

Per run, on the shared filesystem: `runs/<run>/.slurm.json` (the job id, written right after sbatch),
`runs/<run>/.run.json.job` (what was asked, copied for the wrapper at every (re)start), and
`slurm/<submission>/job.sh` (the submitted script; with `<i>` links to the array's run dirs).
State = Slurm's word while it knows the job (scontrol), then sacct where accounting exists, then the
wrapper's status.json; a terminal state that differs from status.json is recorded there once.
"""
from __future__ import annotations

import json
import re
import secrets
import time

from remote_payload.contract import protocol

from ..errors import ConfigError, HostUnreachable, RevalError, RunNotFound
from ..hosts import slurmjobs
from ..hosts.gpuspec import GPUS_SCHEDULER
from ..hosts.transport import q
from ..rundir.registry import (
    NO_ANSWER,
    RunState,
    check_local_runs_root,
    check_run_name,
    clean_status,
    is_run_name,
    load_follow_state,
    save_follow_state,
    symlink_refused,
)
from .base import BATCH_STATE, BATCH_SUBMIT, Backend, JobHandle, Launch, Submission
from .ssh import preflight_sh, script_refusal, wrapper_argv

JOB_ID_ENV = slurmjobs.JOB_ID_ENV
SUBMIT_TIMEOUT_S = 120.0
_ACTIVE = "|".join(sorted(slurmjobs.ACTIVE_STATES))


def alive_probe(job_id: str) -> str:
    """Shell: exit 0 while Slurm has the job queued or running, 1 once it is over, 2 when Slurm cannot say."""
    j = q(job_id)
    return (f'o=$(squeue -h -j {j} -t all -o %T 2>&1); r=$?; if [ $r -ne 0 ]; then case "$o" in '
            f'*"nvalid job id"*) exit 1;; esac; exit 2; fi; case "$o" in {_ACTIVE}) exit 0;; esac; exit 1')


def _heredoc(path_expr: str, text: str, tag: str) -> str:
    if f"\n{tag}\n" in f"\n{text}\n":
        raise RevalError("internal: heredoc delimiter found in its content")
    return f"cat > {path_expr} <<'{tag}'\n{text.rstrip(chr(10))}\n{tag}\n"


def submit_script(workdir: str, token: str, tasks: list[slurmjobs.Task], run_jsons: list[str],
                  batch: str, preflight: list[str] | None = None, env: dict | None = None) -> str:
    """The remote script of one submission (pure): check the eval's paths (`preflight`, before anything is
    created), claim every run name (mkdir; all or none), stage the run.json inputs, write the batch script,
    sbatch it, record each run's job id in its .slurm.json."""
    tag = f"REVAL_EOF_{token}"
    sd = f'"$wd/slurm/{token}"'
    names = " ".join(q(t.name) for t in tasks)
    lines = [
        "trap '' HUP PIPE",  # a dropped connection must not stop it between sbatch and the job-id records
        f"wd={q(workdir)}",
        *preflight_sh(" ".join(q(f"{k}={v}") for k, v in {**(env or {}), "PYTHONUNBUFFERED": "1"}.items()),
                      preflight),
        f'mkdir -p "$wd/runs" {sd} || exit 1',
        '[ -d "$wd/payload" ] || { rm -rf ' + sd + '; echo "@@NOPAYLOAD"; exit 0; }',
        "made=",
        'undo() { for m in $made; do rm -rf "$wd/runs/$m"; done; rm -rf ' + sd + "; }",
        (f'for n in {names}; do if mkdir "$wd/runs/$n" 2>/dev/null; then made="$made $n"; '
        'else echo "@@EXISTS $n"; undo; exit 0; fi; done'),
    ]
    for i, (t, rj) in enumerate(zip(tasks, run_jsons)):
        lines.append(_heredoc(f'"$wd/runs/{t.name}/{slurmjobs.STAGED_RUN_JSON}"', rj, tag))
        if len(tasks) > 1:  # Slurm writes task i's output to slurm/<token>/<i>/eval.log = the run's eval.log
            lines.append(f'ln -s "../../runs/{t.name}" {sd}/{i} || {{ undo; exit 1; }}')
    lines += [
        _heredoc(f"{sd}/job.sh", batch, tag),
        # the job id is stdout's last line; sbatch's warnings (stderr) are not part of it, shown on a refusal
        (f'out=$(cd "$wd" && sbatch --parsable {sd}/job.sh 2>{sd}/sbatch.err) || '
        f'{{ echo "@@SBATCH"; cat {sd}/sbatch.err; printf "%s\\n" "$out"; undo; exit 0; }}'),
        'job=$(printf "%s\\n" "$out" | tail -n 1); job=${job%%;*}',
        f'case "$job" in ""|*[!0-9]*) echo "@@SBATCH"; cat {sd}/sbatch.err; printf "%s\\n" "$out"; exit 0;; esac',
    ]
    for i, t in enumerate(tasks):
        jid = f"${{job}}_{i}" if len(tasks) > 1 else "$job"
        lines.append(f'printf \'{{"job_id": "%s", "submission": "%s", "submitted_at": "%s"}}\\n\' "{jid}" '
                     f'{q(token)} "$(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$wd/runs/{t.name}/{slurmjobs.JOB_FILE}"')
    lines.append('echo "@@JOB $job"')
    return "\n".join(lines) + "\n"


def _run_remote_script(transport, script: str, timeout_s: float) -> str:
    """Upload `script` whole, then run it (a script cut short by a dropped connection never runs)."""
    end = f"# reval-end-{secrets.token_hex(4)}"
    cmd = ('t=$(mktemp) || exit 1; cat > "$t"; if [ "$(tail -n 1 "$t")" = ' + q(end) + ' ]; then sh "$t"; r=$?; '
           'else echo "@@NOINPUT"; r=0; fi; rm -f "$t"; exit $r')
    return transport.run(cmd, input=script + end + "\n", timeout_s=timeout_s).stdout


class SlurmBackend(Backend):
    """A Slurm cluster through its login node (handle `slurm` + the job id, `123` or `123_4`)."""

    kind = "slurm"
    queues = True
    abilities = frozenset({BATCH_SUBMIT, BATCH_STATE})  # one job array; every run's state in two round trips

    @property
    def spec(self) -> slurmjobs.SlurmSpec:
        return self.host.slurm

    def run_slots(self, list_gpus) -> list[str]:
        """Slurm places the runs (their GPUs are the job's): K of them at once, the array's %K."""
        return [GPUS_SCHEDULER] * self.spec.max_running

    def job_device(self, gpus: str) -> str | None:
        """A job computes on the GPUs its cluster entry asks for (slurm.gpus, or a gpu gres), else on CPUs; the
        login node, where its pre-flight runs, may have none."""
        gres = (self.spec.gres or "").split(",")
        return "cuda" if self.spec.gpus or any(g.strip().startswith("gpu") for g in gres) else "cpu"

    def describe_batch(self, launches: list[Launch]) -> str:
        """`job array 123 (at most 2 at once)`, or `job 123` for one run."""
        first = launches[0].handle.job_id.split("_")[0] if launches else "?"
        if len(launches) > 1:
            return f"job array {first} (at most {min(len(launches), self.spec.max_running)} at once)"
        return f"job {first}"

    # -- submit ----------------------------------------------------------------------------------------
    def submit(self, sub: Submission) -> Launch:
        return self.submit_many([sub])[0]

    def submit_many(self, subs: list[Submission], *, max_running: int | None = None) -> list[Launch]:
        """One sbatch for all of them: one job, or a job array of len(subs) tasks, at most K running."""
        if not subs:
            return []
        check_local_runs_root(self.host.name)  # the follow state goes there the moment the job exists
        for s in subs:
            check_run_name(s.name)
            if s.gpus not in ("auto", GPUS_SCHEDULER, None):
                raise ConfigError(f"{self.host.name} is a Slurm cluster: its GPUs are the ones Slurm assigns "
                                  f"(--gpus {s.gpus} cannot choose them)",
                                  hint="ask for GPUs per job in hosts.yaml: slurm: {gpus: N}")
        wd = self.workdir()
        token = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"
        tasks = [slurmjobs.Task(s.name, self.run_dir(s.name),
                                wrapper_argv(s.python, self.run_dir(s.name), f"{wd}/locks", GPUS_SCHEDULER,
                                             s.payload_argv, job_id_env=JOB_ID_ENV)) for s in subs]
        output = (f"{tasks[0].run_dir}/{protocol.EVAL_LOG}" if len(tasks) == 1
                  else f"{wd}/slurm/{token}/%a/{protocol.EVAL_LOG}")
        job_name = f"reval-{subs[0].name}" + (f"-and-{len(subs) - 1}" if len(subs) > 1 else "")
        batch = slurmjobs.batch_script(self.spec, workdir=wd, tasks=tasks, env=self.host.env, job_name=job_name,
                                       output=output, max_running=max_running)
        run_jsons = [json.dumps({**s.run_json, "run": s.name, "host": self.host.name, "python": s.python,
                                 "backend": self.kind}, default=str) for s in subs]
        pf = subs[0].preflight if len(subs) == 1 else None  # an array's bad checkpoint fails in its own task
        script = submit_script(wd, token, tasks, run_jsons, batch,
                               preflight=[subs[0].python, "-m", "remote_payload", *pf] if pf else None,
                               env=self.host.env)
        out = _run_remote_script(self.transport, script, SUBMIT_TIMEOUT_S)
        refused = script_refusal(self.host.name, out, workdir=wd, name=subs[0].name, what="submission")
        if refused:
            raise refused
        if "@@SBATCH" in out:
            why = (out.split("@@SBATCH", 1)[1].strip().splitlines() or ["no output"])[-1]
            raise ConfigError(f"{self.host.name}: sbatch refused the job: {why}",
                              hint=f"check the slurm: settings of {self.host.name} in hosts.yaml; "
                                   f"reval hosts check {self.host.name} lists partitions and limits")
        job = out.split("@@JOB", 1)[1].split()[0] if "@@JOB" in out else ""
        if not job.isdigit():
            raise RevalError(f"{self.host.name}: sbatch gave no job id: {out.strip()[-200:]}", exit_code=1)
        launches = []
        for i, (s, t) in enumerate(zip(subs, tasks)):
            jid = f"{job}_{i}" if len(subs) > 1 else job
            save_follow_state(self.host.name, s.name, run_dir=t.run_dir, python=s.python, log_offset=0,
                              launched_at=protocol.now_iso(), job_id=jid, identity=s.run_json.get("identity"))
            launches.append(Launch(host=self.host.name, name=s.name, run_dir=t.run_dir,
                                   handle=JobHandle(self.kind, jid), device="", queued=True,
                                   status={"state": slurmjobs.QUEUED, "job_id": jid}))
        return launches

    # -- state -----------------------------------------------------------------------------------------
    def _read_runs(self, names: list[str] | None) -> dict[str, dict]:
        """status.json, .slurm.json and the last event of the named runs (None: every run dir)."""
        runs = f"{self.workdir()}/runs"
        m = f"@@{secrets.token_hex(6)}"  # the files' contents cannot fake a section: they don't know it
        each = (f'echo "{m} RUN $n"; echo "{m} STATUS"; cat "$n/status.json" 2>/dev/null; echo; echo "{m} JOB"; '
                f'cat "$n/{slurmjobs.JOB_FILE}" 2>/dev/null; echo; '
                f'echo "{m} EVENT"; tail -n 1 "$n/events.jsonl" 2>/dev/null; echo; '
                f'echo "{m} SUM"; cksum 2>/dev/null < "$n/status.json"; '
                f'echo "{m} KIND"; grep -o \'"kind": *"[a-z]*"\' "$n/run.json" 2>/dev/null | head -n 1 '
                '| cut -d\\" -f4; true')
        # a run folder that is a symbolic link is no run: left out of the listing, refused by name
        loop = ("for n in " + " ".join(q(n) for n in names) + "; do "
                + f'[ ! -L "$n" ] || {{ echo "{m} LINK $n"; continue; }}; ' if names is not None else
                'for n in */; do n=${n%/}; case $n in .*|*[!A-Za-z0-9._-]*) continue;; esac; '
                '[ ! -L "$n" ] || continue; ')
        # the login node's clock, read with the files: their ages are judged by it (remove.age_of)
        script = (f"cd {q(runs)} 2>/dev/null || exit 0\necho \"{m} NOW $(date +%s)\"\n"
                  f"{loop}[ -d \"$n\" ] || continue; {each}; done\n")
        out: dict[str, dict] = {}
        cur, sect, now = None, None, None
        for line in self.transport.run(script, timeout_s=60).stdout.splitlines():
            if line.startswith(f"{m} LINK "):
                raise symlink_refused(self.run_dir(check_run_name(line[len(m) + 6:])), host=self.host.name)
            if line.startswith(f"{m} NOW ") and cur is None:
                now = float(line[len(m) + 5:]) if line[len(m) + 5:].strip().isdigit() else None
            elif line.startswith(f"{m} RUN "):
                cur = line[len(m) + 5:]
                out[cur] = {"STATUS": [], "JOB": [], "EVENT": [], "SUM": [], "KIND": []}
            elif cur is not None and line in (f"{m} STATUS", f"{m} JOB", f"{m} EVENT", f"{m} SUM", f"{m} KIND"):
                sect = line[len(m) + 1:]
            elif cur is not None and sect:
                out[cur][sect].append(line)
        parsed = {}
        for name, parts in out.items():
            if not is_run_name(name):
                continue
            # status.json is untrusted: fields of the wrong type are left out, as the SSH listing does
            objs = {k: _json_obj("\n".join(v)) for k, v in parts.items() if k not in ("SUM", "KIND")}
            kind = "".join(parts["KIND"]).strip()
            # SUM: status.json's checksum as read, so that recording Slurm's word never overwrites a newer one
            parsed[name] = {**objs, "STATUS": clean_status(objs.get("STATUS")), "SUM": "".join(parts["SUM"]).strip(),
                            "NOW": now, "KIND": kind if kind and is_run_name(kind) else "eval"}
        return parsed

    def _query_jobs(self, job_ids: list[str]) -> tuple[dict[str, slurmjobs.JobInfo], dict[str, str]]:
        """Slurm's word on these jobs: scontrol while slurmctld has them, else sacct (accounting, or -c);
        and the jobs Slurm could not answer for ({job id: scontrol's error}: slurmctld unreachable, not
        "no such job") and sacct does not know either: their state is `no-answer`, not gone."""
        ids = [j for j in dict.fromkeys(job_ids) if slurmjobs.is_job_id(j)]
        if not ids:
            return {}, {}
        m = f"@@{secrets.token_hex(6)}"
        script = ("for j in " + " ".join(ids) + "; do o=$(scontrol -o show job \"$j\" 2>&1); "
                  'if [ $? -eq 0 ]; then printf "%s\\n" "$o"; else case "$o" in *"nvalid job id"*) ;; '
                  f'*) echo "{m} NOANSWER $j $(printf "%s" "$o" | head -n 1)";; esac; fi; done\n'
                  "echo @@SACCT\n"
                  "sacct -n -P -X -o JobID,State,ExitCode -j " + ",".join(ids) + " 2>/dev/null || "
                  "sacct -c -n -P -o JobID,State,ExitCode -j " + ",".join(i.split("_")[0] for i in ids)
                  + " 2>/dev/null\n")
        r = self.transport.run(script, timeout_s=120, check=False)
        if r.returncode != 0 and "@@SACCT" not in r.stdout:  # the script itself did not run to its end
            return {}, {j: f"no answer from the login node (exit {r.returncode})" for j in ids}
        live, _, acct = r.stdout.partition("@@SACCT")
        unanswered = {}
        for line in live.splitlines():
            if line.startswith(f"{m} NOANSWER "):
                jid, _, why = line[len(m) + 10:].partition(" ")
                unanswered[jid] = why.strip() or "scontrol failed"
        jobs = {j: i for j, i in slurmjobs.parse_scontrol(live).items() if j in ids}
        for j, info in slurmjobs.parse_sacct(acct).items():
            if j in ids and j not in jobs:
                jobs[j] = info
        return jobs, {j: why for j, why in unanswered.items() if j in ids and j not in jobs}

    def states(self, names: list[str] | None) -> list[RunState]:
        """The states of the named runs (None: every run), two round trips for all of them."""
        runs = self._read_runs(names)
        want = {n: _job_id(r) for n, r in runs.items()}
        # a run whose end is already recorded with Slurm's word needs no query
        jobs, unanswered = self._query_jobs([j for n, j in want.items()
                                             if j and not runs[n]["STATUS"].get("slurm_state")])
        out, fixes = [], {}
        for name, r in runs.items():
            st = r["STATUS"]
            job = jobs.get(want[name]) if want[name] else None
            if want[name] in unanswered and not (st.get("slurm_state") and st.get("state") in protocol.TERMINAL_STATES):
                # Slurm cannot say now: not an end (status.json's `cancelled` may be Slurm's TIMEOUT), never lost
                v = slurmjobs.SlurmRunState(NO_ANSWER, f"Slurm cannot answer: {unanswered[want[name]]}")
            elif (st.get("slurm_state") and st.get("state") in protocol.TERMINAL_STATES) or (job is None and st
                                                                                          and not want[name]):
                v = slurmjobs.slurm_run_state(None, st)  # the recorded end (Slurm's word already in it), or lost
            elif job is None and not want[name]:
                v = slurmjobs.SlurmRunState(protocol.LOST, "no Slurm job recorded")
            else:
                v = slurmjobs.slurm_run_state(job, st)
                fixed = slurmjobs.final_status(st, v, job) if job is not None else None
                if fixed and "finished_at" not in st and r["NOW"] is not None:  # the cluster's clock, not ours
                    fixed["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(r["NOW"]))
                if fixed:
                    fixes[name] = (fixed, r["SUM"])
                    st = fixed
            shown = {**st, "job_id": want[name] or st.get("job_id", "")}
            if v.reason:
                shown["reason"] = v.reason
            if v.exit_code is not None:
                shown.setdefault("exit_code", v.exit_code)
            out.append(RunState(self.host.name, name, v.state, shown, alive=v.state in (slurmjobs.QUEUED,
                                protocol.RUNNING), last_event=r["EVENT"], reason=v.reason, host_now=r["NOW"],
                                kind=r["KIND"]))
        if fixes:
            self._record(fixes)
        return out

    def _record(self, statuses: dict[str, tuple[dict, str]]) -> None:
        """Write Slurm's final word into status.json (atomically: tmp + mv), once per run: {name: (status, the
        checksum of the status.json it was built from)}. A status.json changed since it was read (the wrapper's
        last write, landing between the two reads) is kept: the next look builds on it."""
        tag = f"REVAL_EOF_{secrets.token_hex(4)}"
        script = ""
        for name, (st, read_sum) in statuses.items():
            d = self.run_dir(name)
            tmp, dest = q(d + "/.status.json.slurm.tmp"), q(d + "/" + protocol.STATUS_JSON)
            script += _heredoc(tmp, json.dumps(st, indent=2), tag)
            script += (f'if [ "$(cksum 2>/dev/null < {dest})" = {q(read_sum)} ]; then mv -f {tmp} {dest}; '
                       f"else rm -f {tmp}; fi\n")
        _run_remote_script(self.transport, script, 60)

    def state(self, name: str, *, wait_s: float = 0.0) -> RunState | None:
        """With wait_s: first wait (one round trip) until Slurm says the job is over, at most wait_s."""
        job = self.job_id(name) if wait_s > 0 else None
        if job:
            ticks = max(1, int(wait_s / 0.5))
            self.transport.run(f"i=0; while ( {alive_probe(job)} ) && [ $i -lt {ticks} ]; do sleep 0.5; i=$((i+1)); "
                               "done; true", timeout_s=wait_s + 60, check=False)
        states = self.states([name])
        return states[0] if states else None

    def list_runs(self) -> list[RunState]:
        return sorted(self.states(None), key=lambda s: s.name)

    # -- cancel ----------------------------------------------------------------------------------------
    def cancel(self, name: str, *, grace_s: float = 10.0, known: RunState | None = None) -> RunState:
        """scancel, wait until Slurm says every process of the job is gone, record `cancelled`."""
        st = known if known is not None else self.state(name)
        if st is None:
            raise RunNotFound(f"no run {name!r} on {self.host.name}", hint=f"list them: reval ls {self.host.name}")
        if st.state == NO_ANSWER:  # scancel needs slurmctld too: nothing is cancelled, nor said to be
            raise HostUnreachable(f"{self.host.name}: run {name!r}: {st.reason}; nothing was cancelled",
                                  hint=f"ask again once Slurm answers: reval kill {self.host.name}/{name}")
        job = st.status.get("job_id")
        if st.state in (slurmjobs.QUEUED, protocol.RUNNING) and job:
            ticks = int((grace_s + 60) / 0.5)  # squeue twice a second: slurmctld is shared
            probe = alive_probe(job)
            # The job id comes from files on the cluster: only a job whose output is this run's eval.log (an
            # array task's through its slurm/<submission>/<i> link) is the run's, and only that one is cancelled.
            script = (f"so=$(scontrol -o show job {q(job)} 2>/dev/null | tr ' ' '\\n' | sed -n 's/^StdOut=//p' "
                      "| head -n 1)\n"
                      f'if [ -n "$so" ]; then [ "$(realpath -- "$(dirname -- "$so")" 2>/dev/null)" = '
                      f'"$(realpath -- {q(self.run_dir(name))} 2>/dev/null)" ] || {{ echo "@@NOTOURS $so"; exit 0; }}\n'
                      f"scancel {q(job)}; fi\n"
                      f"i=0; while ( {probe} ); [ $? -ne 1 ] && [ $i -lt {ticks} ]; do sleep 0.5; i=$((i+1)); done\n"
                      f"( {probe} ); echo \"@@ALIVE $?\"\n")
            out = self.transport.run(script, timeout_s=grace_s + 120).stdout
            if "@@NOTOURS" in out:
                theirs = out.split("@@NOTOURS", 1)[1].split("\n", 1)[0].strip() or "?"
                raise RevalError(f"{self.host.name}: Slurm job {job} is not run {name!r}'s (its output goes to "
                                 f"{theirs}); nothing was cancelled",
                                 hint=f"the run's job id is in {self.run_dir(name)}/.slurm.json: check it",
                                 exit_code=3)
            if "@@ALIVE 1" not in out:
                raise RevalError(f"{self.host.name}: job {job} of run {name!r} is still there after scancel",
                                 hint=f"look at it: squeue -j {job} ; scontrol show job {job}", exit_code=1)
            st = self.state(name)
        return st

    def remove(self, name: str) -> None:
        """Delete the run dir, and the submission's folder when it held this run alone (bad input: nothing
        is left behind)."""
        r = self._read_runs([name]).get(name) or {}
        token = (r.get("JOB") or {}).get("submission")
        alone = "_" not in _job_id(r)
        extra = (f" {q(self.workdir() + '/slurm/' + token)}" if alone and isinstance(token, str)
                 and re.fullmatch(r"[0-9A-Za-z-]{1,64}", token) else "")
        self.transport.run(f"rm -rf -- {q(self.run_dir(name))}{extra}", check=False, timeout_s=60)

    # -- follow ----------------------------------------------------------------------------------------
    def job_id(self, name: str) -> str | None:
        jid = load_follow_state(self.host.name, name).get("job_id")
        if isinstance(jid, str) and slurmjobs.is_job_id(jid):
            return jid
        r = self._read_runs([name]).get(name)
        return _job_id(r) if r else None

    def stream_command(self, name: str, *, python: str, log_offset: int, events_offset: int) -> str:
        cmd = super().stream_command(name, python=python, log_offset=log_offset, events_offset=events_offset)
        job = self.job_id(name)
        return cmd + (f" --alive-cmd {q(alive_probe(job))}" if job else "")


def _json_obj(text: str) -> dict:
    try:
        v = protocol.loads(text) if text.strip() else {}
    except ValueError:  # not JSON, or nested too deep
        return {}
    return v if isinstance(v, dict) else {}


def _job_id(r: dict) -> str:
    for src in (r.get("JOB", {}).get("job_id"), r.get("STATUS", {}).get("job_id")):
        if isinstance(src, str) and slurmjobs.is_job_id(src):
            return src
    return ""
