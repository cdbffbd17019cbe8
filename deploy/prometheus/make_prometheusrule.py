#!/usr/bin/env python3
"""Writes the PrometheusRule of the prometheus-operator overlay from
rules.yml, the one source of the alert rules (promtool checks and unit-tests
rules.yml; tests/deploy/test_deploy.py fails when the two differ).

Run after editing rules.yml: deploy/prometheus/make_prometheusrule.py
"""

import os
import sys

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
RULES = os.path.join(HERE, "rules.yml")
OUTPUT = os.path.join(HERE, "..", "k8s", "overlays", "prometheus-operator",
                      "monitoring", "prometheusrule.yaml")
HEADER = """\
# Generated from deploy/prometheus/rules.yml by
# deploy/prometheus/make_prometheusrule.py: edit rules.yml and rerun it.
# The selector label (release: ...) comes from monitoring/kustomization.yaml.
"""


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper, value):
    # Multi-line PromQL and descriptions stay readable as block scalars.
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render():
    with open(RULES) as f:
        rules = yaml.safe_load(f)
    resource = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "flashsampler",
                     "labels": {"app.kubernetes.io/name": "flashsampler"}},
        "spec": {"groups": rules["groups"]},
    }
    return HEADER + yaml.dump(resource, Dumper=_Dumper, sort_keys=False,
                              width=1000)


def main():
    with open(OUTPUT, "w") as f:
        f.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
