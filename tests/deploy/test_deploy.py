"""Consistency of the deployment files: the Kubernetes manifests agree with
each other (ports, labels, probes, drain timing, GPUs, NCCL environment),
with the Dockerfile, and, when FLASHSAMPLERD names the built daemon, every
flag they pass exists in `flashsamplerd --helpfull`.

Run: /usr/bin/python3 -m unittest test_deploy (from tests/client/python).
"""

import json
import os
import re
import subprocess
import unittest

import yaml

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..",
                                    ".."))
DEPLOY = os.path.join(REPO, "deploy")
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1",
                    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def load_all(name):
    with open(os.path.join(DEPLOY, "k8s", name)) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def parse_duration_s(text):
    match = re.fullmatch(r"(\d+)(ms|s|m)", text)
    assert match, f"unsupported duration {text}"
    value, unit = int(match.group(1)), match.group(2)
    return value * {"ms": 0.001, "s": 1, "m": 60}[unit]


def flag_names(args):
    return [a[2:].split("=", 1)[0] for a in args if a.startswith("--")]


class ManifestTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        docs = load_all("deployment.yaml")
        cls.deployment = next(d for d in docs if d["kind"] == "Deployment")
        cls.pdb = next(d for d in docs if d["kind"] == "PodDisruptionBudget")
        cls.services = {d["metadata"]["name"]: d
                        for d in load_all("service.yaml")}
        cls.monitor = load_all("servicemonitor.yaml")[0]
        cls.pod = cls.deployment["spec"]["template"]["spec"]
        cls.container = cls.pod["containers"][0]
        cls.ports = {p["name"]: p["containerPort"]
                     for p in cls.container["ports"]}
        cls.args = dict(a[2:].split("=", 1) for a in cls.container["args"])

    def test_takes_all_eight_gpus(self):
        resources = self.container["resources"]
        self.assertEqual(resources["limits"]["nvidia.com/gpu"], 8)
        self.assertEqual(resources["requests"]["nvidia.com/gpu"], 8)
        self.assertEqual(self.args["tp"], "8")

    def test_no_nvlink_multicast_environment(self):
        env = {e["name"]: e["value"] for e in self.container["env"]}
        for name, value in NO_MULTICAST_ENV.items():
            self.assertEqual(env.get(name), value, name)

    def test_probes_use_grpc_health_on_the_grpc_port(self):
        listen_port = int(self.args["listen_address"].rsplit(":", 1)[1])
        self.assertEqual(self.ports["grpc"], listen_port)
        self.assertEqual(self.ports["metrics"], int(self.args["metrics_port"]))
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            self.assertEqual(self.container[probe]["grpc"]["port"],
                             listen_port, probe)
        self.assertEqual(
            self.container["readinessProbe"]["grpc"]["service"],
            "flashsampler.v1.Sampler")

    def test_drain_timing_is_consistent(self):
        drain_s = parse_duration_s(self.args["drain_timeout"])
        pre_stop = self.container["lifecycle"]["preStop"]["exec"]["command"]
        self.assertEqual(pre_stop[0], "/bin/sleep")
        pre_stop_s = int(pre_stop[1])
        grace_s = self.pod["terminationGracePeriodSeconds"]
        # SIGKILL must come after the preStop sleep and the whole drain.
        self.assertGreater(grace_s, pre_stop_s + drain_s)
        # A draining pod answers NOT_SERVING: liveness must not restart it.
        liveness = self.container["livenessProbe"]
        self.assertGreater(
            liveness["periodSeconds"] * liveness["failureThreshold"],
            pre_stop_s + drain_s)

    def test_services_select_the_pods_and_name_real_ports(self):
        pod_labels = self.deployment["spec"]["template"]["metadata"]["labels"]
        self.assertEqual(self.deployment["spec"]["selector"]["matchLabels"],
                         pod_labels)
        self.assertEqual(self.pdb["spec"]["selector"]["matchLabels"],
                         pod_labels)
        for name, service in self.services.items():
            for key, value in service["spec"]["selector"].items():
                self.assertEqual(pod_labels.get(key), value, name)
            for port in service["spec"]["ports"]:
                self.assertIn(port["targetPort"], self.ports, name)
        headless = self.services["flashsampler-headless"]["spec"]
        self.assertEqual(headless["clusterIP"], "None")
        self.assertFalse(headless.get("publishNotReadyAddresses", False))
        metrics = self.services["flashsampler-metrics"]["spec"]
        self.assertEqual(metrics["clusterIP"], "None")
        self.assertTrue(metrics["publishNotReadyAddresses"])
        self.assertEqual(self.services["flashsampler"]["spec"]["type"],
                         "ClusterIP")

    def test_service_monitor_scrapes_the_metrics_port_once(self):
        selector = self.monitor["spec"]["selector"]["matchLabels"]
        selected = [s for s in self.services.values()
                    if all(s["metadata"]["labels"].get(k) == v
                           for k, v in selector.items())]
        port = self.monitor["spec"]["endpoints"][0]["port"]
        with_port = [s for s in selected
                     if any(p["name"] == port for p in s["spec"]["ports"])]
        self.assertEqual([s["metadata"]["name"] for s in with_port],
                         ["flashsampler"])

    def test_plain_prometheus_config_finds_the_metrics_service(self):
        with open(os.path.join(DEPLOY, "prometheus", "prometheus.yml")) as f:
            config = yaml.safe_load(f)
        job = config["scrape_configs"][0]
        self.assertEqual(job["job_name"], "flashsampler")
        sd = job["dns_sd_configs"][0]
        self.assertTrue(sd["names"][0].startswith("flashsampler-metrics."))
        self.assertEqual(sd["port"], self.ports["metrics"])

    def test_dockerfile_matches(self):
        with open(os.path.join(DEPLOY, "Dockerfile")) as f:
            dockerfile = f.read()
        self.assertIn("FROM debian:12 AS build", dockerfile)
        self.assertIn("FROM debian:12 AS runtime", dockerfile)
        self.assertIn("scripts/install_deps.sh", dockerfile)
        for name, value in NO_MULTICAST_ENV.items():
            self.assertRegex(dockerfile, rf"{name}={value}\b")
        self.assertIn(f"EXPOSE {self.ports['grpc']} {self.ports['metrics']}",
                      dockerfile)
        uid = self.pod["securityContext"]["runAsUser"]
        self.assertIn(f"USER {uid}:{uid}", dockerfile)

    def test_grafana_dashboard_is_valid(self):
        path = os.path.join(DEPLOY, "grafana", "flashsampler-dashboard.json")
        with open(path) as f:
            dashboard = json.load(f)
        ids = [p["id"] for p in dashboard["panels"]]
        self.assertEqual(len(ids), len(set(ids)))
        exprs = [t["expr"] for p in dashboard["panels"]
                 for t in p.get("targets", [])]
        self.assertGreater(len(exprs), 10)
        for expr in exprs:
            self.assertIn("flashsampler_", expr)
            self.assertEqual(expr.count("("), expr.count(")"), expr)

    @unittest.skipUnless(os.environ.get("FLASHSAMPLERD"),
                         "FLASHSAMPLERD (the built daemon) not given")
    def test_every_flag_exists_in_the_daemon(self):
        helpfull = subprocess.run(
            [os.environ["FLASHSAMPLERD"], "--helpfull"], capture_output=True,
            text=True, timeout=30)
        text = helpfull.stdout + helpfull.stderr
        known = set(re.findall(r"^\s+--([a-z_0-9]+)", text, re.MULTILINE))
        self.assertIn("listen_address", known)
        with open(os.path.join(DEPLOY, "Dockerfile")) as f:
            cmd = re.search(r'CMD \[(.*?)\]', f.read(), re.DOTALL).group(1)
        docker_args = re.findall(r'"(--[^"]+)"', cmd)
        for flag in flag_names(self.container["args"]) + flag_names(
                docker_args):
            self.assertIn(flag, known, f"--{flag} is not a flashsamplerd flag")


if __name__ == "__main__":
    unittest.main()
