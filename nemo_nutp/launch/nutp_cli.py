"""``nutp``: the command-line front end (``nutp plan``, ``nutp sbatch``, ``nutp simulate``)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from ..common.console import make_console, print_error


def _plan(args: argparse.Namespace) -> int:
    from ..common.plan_report import print_plan
    from ..config import plan_request
    from ..config.recipes import load_job
    from ..layout import HealthReport, build_plan
    from ..layout.serialize import plan_to_dict, write_json_atomic

    console = make_console()
    try:
        cfg = load_job(args.overrides, config_name=args.config_name, recipe=args.recipe)
        req = plan_request(cfg)
        if args.failed:
            extra = HealthReport.from_cli(args.failed).failed_gpus
            health = dataclasses.replace(req.health, failed_gpus=req.health.failed_gpus + extra)
            req = dataclasses.replace(req, health=health)  # slow_gpus kept
        t0 = time.perf_counter()
        plan = build_plan(req)
        elapsed = time.perf_counter() - t0
    except ValueError as e:
        print_error(str(e))
        return 2
    comparison = print_plan(plan, console)
    console.print(f"planned in {elapsed * 1e3:.1f} ms; reshard {plan.reshard_bytes() / 1e6:.2f}"
                  f" MB/step (fp32 grads)")
    if args.json:
        data = plan_to_dict(plan)
        data["policies"] = comparison
        write_json_atomic(data, args.json)
        console.print(f"plan written to {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from ..common.quiet import quiet_optional_kernel_notes

    quiet_optional_kernel_notes()
    parser = argparse.ArgumentParser(prog="nutp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan replicas, ranks, groups and shares for a cluster")
    p.add_argument("overrides", nargs="*", help="Hydra-style overrides, e.g. cluster=nvl72")
    p.add_argument("--json", metavar="PATH", help="write the plan as JSON")
    p.add_argument("--failed", metavar="IDS", help="extra failed GPUs, e.g. 3,17,40-43")
    p.add_argument("--config-name", default="config", help="primary config in configs/")
    p.add_argument("--recipe", help="a recipe in recipes/ (same as the override recipe=NAME)")
    p.set_defaults(func=_plan)
    from ..goodput.report import add_parser as add_simulate
    from .slurm import add_parser as add_sbatch

    add_sbatch(sub)
    add_simulate(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
