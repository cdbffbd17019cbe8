"""Consistency of the deployment files: every kustomize overlay renders (the
Python subset in kustomize_lite.py, checked against `kubectl kustomize`
where one with kustomize v5 is installed) into objects that validate
against the Kubernetes schemas (kubernetes-validate, when installed), meet
the "restricted" Pod Security Standard, roll out on a full GPU pool, agree
with each other, with the alert rules, with the Dockerfile and with the
daemon (flags from `flashsamplerd --helpfull` when FLASHSAMPLERD names the
built binary; metric names from service/ sources).

Run: /usr/bin/python3 -m unittest -v test_deploy (from tests/deploy).
"""

import json
import os
import re
import shutil
import subprocess
import tempfile
import unittest

import yaml

import kustomize_lite

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEPLOY = os.path.join(REPO, "deploy")
K8S = os.path.join(DEPLOY, "k8s")
OVERLAYS = {"prometheus": os.path.join(K8S, "overlays", "prometheus"),
            "prometheus-operator": os.path.join(K8S, "overlays",
                                                "prometheus-operator")}
MONITORING = os.path.join(OVERLAYS["prometheus-operator"], "monitoring")
DASHBOARD = os.path.join(DEPLOY, "grafana", "flashsampler-dashboard.json")
RULES = os.path.join(DEPLOY, "prometheus", "rules.yml")
PROMETHEUS_CONFIG = os.path.join(DEPLOY, "prometheus", "prometheus.yml")
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1",
                    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
# Kubernetes release whose schemas the objects are validated against.
KUBERNETES_VERSION = "1.32.0"
# The serving-state gauges the rules and dashboard use; test_metrics_exist
# reports them separately until the daemon's sources define them.
SERVING_STATE_METRICS = {"flashsampler_serving_state",
                         "flashsampler_load_progress_ratio"}
# dcgm-exporter metrics (its default counter set) the GPU row uses.
DCGM_METRICS = {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED",
                "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_SM_CLOCK",
                "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_XID_ERRORS"}


def render(overlay):
    return {(o["kind"], o["metadata"]["name"]): o
            for o in kustomize_lite.build(OVERLAYS[overlay])}


def parse_duration_s(text):
    match = re.fullmatch(r"(\d+)(ms|s|m|h)", str(text))
    assert match, f"unsupported duration {text}"
    value, unit = int(match.group(1)), match.group(2)
    return value * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]


def flag_names(args):
    return [a[2:].split("=", 1)[0] for a in args if a.startswith("--")]


def load_yaml(path):
    with open(path) as f:
        return yaml.safe_load(f)


def read(path):
    with open(path) as f:
        return f.read()


def exported_metrics():
    """Metric names the daemon registers (.Name("...") in service/)."""
    names = set()
    for root, _, files in os.walk(os.path.join(REPO, "service")):
        for name in files:
            if name.endswith((".cc", ".h")):
                names |= set(re.findall(r'\.Name\(\s*"(flashsampler_\w+)"',
                                        read(os.path.join(root, name))))
    return names


def used_metrics(text):
    """flashsampler_* series names in PromQL, histogram suffixes removed;
    recording-rule names (level:metric:operation) are not series."""
    names = set()
    for match in re.finditer(r"(?<![\w:])(flashsampler_\w+)(?![\w:])", text):
        names.add(re.sub(r"_(bucket|sum|count)$", "", match.group(1)))
    return names


def alert(name):
    for group in load_yaml(RULES)["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == name:
                return rule
    raise KeyError(name)


def kubectl_kustomize():
    """`kubectl` when its kustomize is v5 or newer, else None."""
    kubectl = shutil.which("kubectl")
    if not kubectl:
        return None
    version = subprocess.run([kubectl, "version", "--client"],
                             capture_output=True, text=True, timeout=30)
    match = re.search(r"Kustomize Version: v(\d+)", version.stdout)
    return kubectl if match and int(match.group(1)) >= 5 else None


def relabel(meta, configs):
    """Applies Prometheus relabel_configs (keep and replace) to a target's
    labels; None when it is dropped."""
    labels = dict(meta)
    for config in configs:
        value = config.get("separator", ";").join(
            labels.get(name, "") for name in config.get("source_labels", []))
        regex = re.compile(config.get("regex", "(.*)"))
        action = config.get("action", "replace")
        match = regex.fullmatch(value)
        if action == "keep":
            if not match:
                return None
        elif action == "replace":
            if match:
                labels[config["target_label"]] = match.expand(
                    config.get("replacement", "$1").replace("$1", r"\1"))
        else:
            raise ValueError(f"relabel action {action} not simulated")
    return {k: v for k, v in labels.items()
            if not k.startswith("__") or k == "__metrics_path__"}


class RenderTest(unittest.TestCase):

    def test_python_render_matches_kubectl_kustomize(self):
        kubectl = kubectl_kustomize()
        if not kubectl:
            self.skipTest("no kubectl with kustomize v5: the Python render "
                          "is not cross-checked")
        for overlay, path in OVERLAYS.items():
            out = subprocess.run([kubectl, "kustomize", path], check=True,
                                 capture_output=True, text=True, timeout=60)
            theirs = {(o["kind"], o["metadata"]["name"]): o
                      for o in yaml.safe_load_all(out.stdout) if o}
            self.assertEqual(render(overlay), theirs, overlay)

    def test_objects_validate_against_kubernetes_schemas(self):
        try:
            import kubernetes_validate  # pylint: disable=import-outside-toplevel
        except ImportError:
            self.skipTest("kubernetes-validate not installed: pip install "
                          "kubernetes-validate")
        for overlay in OVERLAYS:
            for key, obj in render(overlay).items():
                if obj["apiVersion"].startswith("monitoring.coreos.com/"):
                    continue  # CRDs: checked field by field below
                with self.subTest(overlay=overlay, object=key):
                    kubernetes_validate.validate(obj, KUBERNETES_VERSION,
                                                 strict=True)
        # The validator catches a misspelt field.
        deployment = render("prometheus")[("Deployment", "flashsampler")]
        broken = json.loads(json.dumps(deployment))
        broken["spec"]["template"]["spec"]["containers"][0]["readOnlyRoot"] = 1
        with self.assertRaises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, KUBERNETES_VERSION,
                                         strict=True)

    def test_overlays_differ_only_in_monitoring(self):
        plain, operator = render("prometheus"), render("prometheus-operator")
        self.assertEqual(
            set(operator) - set(plain),
            {("ServiceMonitor", "flashsampler"),
             ("PrometheusRule", "flashsampler")})
        self.assertEqual(set(plain) - set(operator),
                         {("ConfigMap", "flashsampler-prometheus")})
        for key in ("PersistentVolumeClaim", "flashsampler-models"), (
                "ConfigMap", "flashsampler-dashboard"), (
                "PodDisruptionBudget", "flashsampler"):
            self.assertIn(key, plain)


class ManifestTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.objects = render("prometheus-operator")
        cls.deployment = cls.objects[("Deployment", "flashsampler")]
        cls.pdb = cls.objects[("PodDisruptionBudget", "flashsampler")]
        cls.services = {name: o for (kind, name), o in cls.objects.items()
                        if kind == "Service"}
        cls.monitor = cls.objects[("ServiceMonitor", "flashsampler")]
        cls.rule = cls.objects[("PrometheusRule", "flashsampler")]
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

    def test_explicit_cuda_backend_and_weights(self):
        self.assertEqual(self.args.get("backend"), "cuda")
        weights = self.args.get("weights", "")
        self.assertTrue(weights.startswith("/models/"), weights)
        mounts = {m["mountPath"]: m for m in self.container["volumeMounts"]}
        self.assertTrue(mounts["/models"]["readOnly"])
        volumes = {v["name"]: v for v in self.pod["volumes"]}
        claim = volumes[mounts["/models"]["name"]]["persistentVolumeClaim"]
        self.assertIn(("PersistentVolumeClaim", claim["claimName"]),
                      self.objects)

    def test_image_names_a_registry(self):
        image = self.container["image"]
        registry = image.split("/", 1)[0]
        self.assertIn("/", image)
        self.assertRegex(registry, r"[.:]|^localhost$", image)
        self.assertRegex(image, r":[\w][\w.-]*$", image)

    def test_no_nvlink_multicast_environment(self):
        env = {e["name"]: e["value"] for e in self.container["env"]}
        for name, value in NO_MULTICAST_ENV.items():
            self.assertEqual(env.get(name), value, name)

    def test_restricted_pod_security_standard(self):
        pod_sc = self.pod["securityContext"]
        sc = self.container["securityContext"]
        self.assertTrue(sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")))
        uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
        self.assertIsInstance(uid, int)
        self.assertGreater(uid, 0)
        self.assertIs(sc["allowPrivilegeEscalation"], False)
        self.assertEqual(sc["capabilities"]["drop"], ["ALL"])
        self.assertNotIn("add", sc["capabilities"])
        self.assertFalse(sc.get("privileged", False))
        for context in (sc, pod_sc):
            self.assertIn(context.get("seccompProfile", {}).get("type"),
                          (None, "RuntimeDefault", "Localhost"))
        self.assertEqual(
            sc.get("seccompProfile", pod_sc.get("seccompProfile"))["type"],
            "RuntimeDefault")
        self.assertIs(sc["readOnlyRootFilesystem"], True)
        # Volume types the restricted profile allows; /tmp stays writable.
        allowed = {"configMap", "csi", "downwardAPI", "emptyDir",
                   "ephemeral", "persistentVolumeClaim", "projected",
                   "secret"}
        volumes = {v["name"]: v for v in self.pod["volumes"]}
        for volume in volumes.values():
            self.assertLessEqual(set(volume) - {"name"}, allowed, volume)
        mounts = {m["mountPath"]: m["name"]
                  for m in self.container["volumeMounts"]}
        self.assertIn("emptyDir", volumes[mounts["/tmp"]])
        for field in ("hostNetwork", "hostPID", "hostIPC"):
            self.assertFalse(self.pod.get(field, False), field)
        for port in self.container["ports"]:
            self.assertNotIn("hostPort", port)

    def test_rollout_completes_on_a_full_gpu_pool(self):
        rolling = self.deployment["spec"]["strategy"]["rollingUpdate"]
        self.assertEqual(rolling["maxSurge"], 0)
        self.assertEqual(rolling["maxUnavailable"], 1)
        self.assertEqual(self.pdb["spec"]["maxUnavailable"],
                         rolling["maxUnavailable"])
        self.assertNotIn("minAvailable", self.pdb["spec"])

    def test_readiness_tolerates_one_slow_reply(self):
        for name in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = self.container[name]
            self.assertLess(probe.get("timeoutSeconds", 1),
                            probe["periodSeconds"], name)
        readiness = self.container["readinessProbe"]
        self.assertGreaterEqual(readiness["failureThreshold"], 2)
        self.assertGreaterEqual(readiness.get("timeoutSeconds", 1), 2)

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
        # Readiness takes a draining pod out of the Services before the
        # preStop sleep and the drain are over.
        readiness = self.container["readinessProbe"]
        self.assertLess(
            readiness["periodSeconds"] * readiness["failureThreshold"],
            pre_stop_s + drain_s)

    def test_alerts_wait_out_the_startup_probe(self):
        startup = self.container["startupProbe"]
        budget_s = startup["periodSeconds"] * startup["failureThreshold"]
        self.assertEqual(budget_s, 600)
        self.assertGreaterEqual(
            parse_duration_s(alert("FlashsamplerDown")["for"]), budget_s)
        self.assertGreaterEqual(
            parse_duration_s(alert("FlashsamplerPodNotReady")["for"]),
            budget_s)
        self.assertEqual(
            parse_duration_s(alert("FlashsamplerLoadingTooLong")["for"]),
            budget_s)
        # NotServing must outlast a drain (preStop + --drain_timeout).
        drain_s = parse_duration_s(self.args["drain_timeout"]) + int(
            self.container["lifecycle"]["preStop"]["exec"]["command"][1])
        self.assertGreater(
            parse_duration_s(alert("FlashsamplerNotServing")["for"]), drain_s)

    def test_services_select_the_pods_and_name_real_ports(self):
        pod_labels = self.deployment["spec"]["template"]["metadata"]["labels"]
        selector = self.deployment["spec"]["selector"]["matchLabels"]
        for key, value in selector.items():
            self.assertEqual(pod_labels.get(key), value)
        self.assertEqual(self.pdb["spec"]["selector"]["matchLabels"],
                         selector)
        for name, service in self.services.items():
            for key, value in service["spec"]["selector"].items():
                self.assertEqual(pod_labels.get(key), value, name)
            for port in service["spec"]["ports"]:
                self.assertIn(port["targetPort"], self.ports, name)
        headless = self.services["flashsampler-headless"]["spec"]
        self.assertEqual(headless["clusterIP"], "None")
        self.assertFalse(headless.get("publishNotReadyAddresses", False))
        self.assertEqual(self.services["flashsampler"]["spec"]["type"],
                         "ClusterIP")

    def test_service_monitor_scrapes_the_metrics_port_once(self):
        selector = self.monitor["spec"]["selector"]["matchLabels"]
        selected = [s for s in self.services.values()
                    if all(s["metadata"]["labels"].get(k) == v
                           for k, v in selector.items())]
        endpoint = self.monitor["spec"]["endpoints"][0]
        with_port = [s for s in selected
                     if any(p["name"] == endpoint["port"]
                            for p in s["spec"]["ports"])]
        self.assertEqual([s["metadata"]["name"] for s in with_port],
                         ["flashsampler"])
        # The labels rules.yml and the dashboard select on.
        self.assertIn({"targetLabel": "job", "replacement": "flashsampler"},
                      endpoint["relabelings"])
        self.assertIn("model", self.monitor["spec"]["podTargetLabels"])
        self.assertIn("model",
                      self.deployment["spec"]["template"]["metadata"]
                      ["labels"])

    def test_monitoring_objects_carry_the_selector_label(self):
        knob = load_yaml(os.path.join(MONITORING, "kustomization.yaml"))
        pairs = knob["labels"][0]["pairs"]
        self.assertEqual(pairs, {"release": "kube-prometheus-stack"})
        for obj in (self.monitor, self.rule):
            for key, value in pairs.items():
                self.assertEqual(obj["metadata"]["labels"].get(key), value,
                                 obj["kind"])

    def test_prometheus_rule_is_rules_yml(self):
        self.assertEqual(self.rule["spec"]["groups"],
                         load_yaml(RULES)["groups"])
        import importlib.util  # pylint: disable=import-outside-toplevel
        spec = importlib.util.spec_from_file_location(
            "make_prometheusrule",
            os.path.join(DEPLOY, "prometheus", "make_prometheusrule.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        self.assertEqual(
            read(os.path.join(MONITORING, "prometheusrule.yaml")),
            module.render(),
            "rerun deploy/prometheus/make_prometheusrule.py")

    def test_grafana_dashboard_configmap(self):
        config_map = self.objects[("ConfigMap", "flashsampler-dashboard")]
        self.assertEqual(config_map["metadata"]["labels"]["grafana_dashboard"],
                         "1")
        self.assertEqual(
            json.loads(config_map["data"]["flashsampler-dashboard.json"]),
            json.loads(read(DASHBOARD)))

    @unittest.skipUnless(os.environ.get("FLASHSAMPLERD"),
                         "FLASHSAMPLERD (the built daemon) not given")
    def test_every_flag_exists_in_the_daemon(self):
        helpfull = subprocess.run(
            [os.environ["FLASHSAMPLERD"], "--helpfull"], capture_output=True,
            text=True, timeout=30)
        text = helpfull.stdout + helpfull.stderr
        known = set(re.findall(r"^\s+--([a-z_0-9]+)", text, re.MULTILINE))
        self.assertIn("listen_address", known)
        cmd = re.search(r'CMD \[(.*?)\]', read(os.path.join(
            DEPLOY, "Dockerfile")), re.DOTALL).group(1)
        docker_args = re.findall(r'"(--[^"]+)"', cmd)
        for flag in flag_names(self.container["args"]) + flag_names(
                docker_args):
            self.assertIn(flag, known, f"--{flag} is not a flashsamplerd flag")


class PlainPrometheusTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.objects = render("prometheus")
        cls.deployment = cls.objects[("Deployment", "flashsampler")]
        cls.job = load_yaml(PROMETHEUS_CONFIG)["scrape_configs"][0]

    def pod_target(self, annotations, labels, port_name):
        meta = {"__address__": "10.0.0.7:9400",
                "__meta_kubernetes_namespace": "ml",
                "__meta_kubernetes_pod_name": "flashsampler-abc",
                "__meta_kubernetes_pod_container_name": "flashsampler",
                "__meta_kubernetes_pod_container_port_name": port_name}
        for key, value in annotations.items():
            meta["__meta_kubernetes_pod_annotation_" +
                 re.sub(r"[^a-zA-Z0-9_]", "_", key)] = value
        for key, value in labels.items():
            meta["__meta_kubernetes_pod_label_" +
                 re.sub(r"[^a-zA-Z0-9_]", "_", key)] = value
        target = relabel(meta, self.job["relabel_configs"])
        if target is not None:
            target["job"] = self.job["job_name"]
        return target

    def test_discovers_pods_through_the_kubernetes_api(self):
        self.assertEqual(self.job["job_name"], "flashsampler")
        self.assertNotIn("dns_sd_configs", self.job)
        sd = self.job["kubernetes_sd_configs"]
        self.assertEqual([c["role"] for c in sd], ["pod"])
        self.assertNotIn("namespaces", sd[0])

    def test_overlay_pods_are_scraped_with_namespace_pod_and_model(self):
        template = self.deployment["spec"]["template"]
        container = template["spec"]["containers"][0]
        metrics_port = next(p for p in container["ports"]
                            if p["name"] == "metrics")
        annotations = template["metadata"]["annotations"]
        self.assertEqual(annotations["prometheus.io/port"],
                         str(metrics_port["containerPort"]))
        labels = template["metadata"]["labels"]
        target = self.pod_target(annotations, labels, "metrics")
        self.assertEqual(target["job"], "flashsampler")
        self.assertEqual(target["namespace"], "ml")
        self.assertEqual(target["pod"], "flashsampler-abc")
        self.assertEqual(target["model"], labels["model"])
        self.assertEqual(target["__metrics_path__"], "/metrics")
        self.assertNotIn("instance", target)
        # One target per pod: the gRPC port is not scraped.
        self.assertIsNone(self.pod_target(annotations, labels, "grpc"))
        # Without the overlay's annotation a pod is left alone.
        self.assertIsNone(self.pod_target({}, labels, "metrics"))

    def test_config_map_ships_the_job_and_rules(self):
        data = self.objects[("ConfigMap", "flashsampler-prometheus")]["data"]
        self.assertEqual(data["prometheus.yml"], read(PROMETHEUS_CONFIG))
        self.assertEqual(data["rules.yml"], read(RULES))

    @unittest.skipUnless(os.environ.get("PROMTOOL"), "PROMTOOL not given")
    def test_promtool_checks_the_config(self):
        # Debian's Prometheus is built without Kubernetes discovery, so
        # promtool checks a copy whose targets are static; the relabeling
        # and the rule files are checked as written.
        config = load_yaml(PROMETHEUS_CONFIG)
        job = config["scrape_configs"][0]
        del job["kubernetes_sd_configs"]
        job["static_configs"] = [{"targets": ["flashsampler:9400"]}]
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(RULES, tmp)
            path = os.path.join(tmp, "prometheus.yml")
            with open(path, "w") as f:
                yaml.safe_dump(config, f)
            result = subprocess.run(
                [os.environ["PROMTOOL"], "check", "config", path],
                capture_output=True, text=True, timeout=60)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)


class DockerfileTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.dockerfile = read(os.path.join(DEPLOY, "Dockerfile"))
        cls.cmd = re.findall(r'"(--[^"]+)"', re.search(
            r'CMD \[(.*?)\]', cls.dockerfile, re.DOTALL).group(1))
        deployment = render("prometheus")[("Deployment", "flashsampler")]
        cls.pod = deployment["spec"]["template"]["spec"]

    def test_build_and_runtime_stages(self):
        self.assertIn("FROM debian:12 AS build", self.dockerfile)
        self.assertIn("FROM debian:12 AS runtime", self.dockerfile)
        self.assertIn("scripts/install_deps.sh", self.dockerfile)
        self.assertIn("/build/bin/flashsamplerd", self.dockerfile)
        ports = {p["name"]: p["containerPort"]
                 for p in self.pod["containers"][0]["ports"]}
        self.assertIn(f"EXPOSE {ports['grpc']} {ports['metrics']}",
                      self.dockerfile)

    def test_nvidia_environment(self):
        for name, value in {
                "NVIDIA_VISIBLE_DEVICES": "all",
                "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
                "NVIDIA_REQUIRE_CUDA": '"cuda>=13.0 driver>=580"',
                **NO_MULTICAST_ENV}.items():
            self.assertRegex(self.dockerfile,
                             rf"\b{name}={re.escape(value)}(\s|$)", name)

    def test_oci_labels(self):
        for key in ("title", "description", "version", "revision"):
            self.assertIn(f"org.opencontainers.image.{key}=",
                          self.dockerfile)

    def test_only_linked_runtime_libraries(self):
        # flashsamplerd serves /metrics itself with prometheus-cpp core.
        self.assertNotIn("prometheus-cpp-pull", self.dockerfile)
        self.assertNotRegex(self.dockerfile, r"libcublas-\d")

    def test_explicit_backend_and_weights_non_root(self):
        self.assertIn("--backend=cuda", self.cmd)
        self.assertTrue(any(a.startswith("--weights=/models/")
                            for a in self.cmd), self.cmd)
        user = re.search(r"^USER (\S+)", self.dockerfile, re.MULTILINE)
        self.assertRegex(user.group(1), r"^[1-9]\d*:[1-9]\d*$")
        uid = self.pod["securityContext"]["runAsUser"]
        self.assertEqual(user.group(1), f"{uid}:{uid}")


class DashboardAndRulesTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        with open(DASHBOARD) as f:
            cls.dashboard = json.load(f)
        cls.panels = cls.dashboard["panels"]
        cls.exprs = [t["expr"] for p in cls.panels
                     for t in p.get("targets", [])]

    def test_variables(self):
        variables = {v["name"]: v
                     for v in self.dashboard["templating"]["list"]}
        self.assertEqual(set(variables),
                         {"datasource", "namespace", "pod", "model"})
        self.assertEqual(variables["datasource"]["type"], "datasource")
        for name in ("namespace", "pod", "model"):
            self.assertEqual(variables[name]["datasource"]["uid"],
                             "${datasource}")
            self.assertIn(f"{name})", variables[name]["definition"])

    def test_panels_select_on_variables_not_job(self):
        ids = [p["id"] for p in self.panels]
        self.assertEqual(len(ids), len(set(ids)))
        self.assertGreater(len(self.exprs), 10)
        for expr in self.exprs:
            self.assertNotIn("job=", expr)
            self.assertNotIn("instance", expr)
            self.assertIn('namespace=~"$namespace"', expr)
            self.assertIn('pod=~"$pod"', expr)
            self.assertEqual(expr.count("("), expr.count(")"), expr)
        for panel in self.panels:
            if panel.get("targets"):
                self.assertEqual(panel["datasource"]["uid"], "${datasource}")

    def test_gpu_row_uses_dcgm_exporter(self):
        rows = [p["title"] for p in self.panels if p["type"] == "row"]
        self.assertTrue(any("GPU" in row for row in rows), rows)
        used = set(re.findall(r"\bDCGM_FI_\w+", " ".join(self.exprs)))
        self.assertEqual(used, DCGM_METRICS)

    def test_metrics_exist(self):
        exported = exported_metrics()
        self.assertIn("flashsampler_requests_total", exported)
        used = used_metrics(" ".join(self.exprs)) | used_metrics(read(RULES))
        self.assertLessEqual(SERVING_STATE_METRICS, used)
        missing = used - exported - SERVING_STATE_METRICS
        self.assertEqual(missing, set(),
                         "used by the dashboard or rules.yml, not exported")

    def test_serving_state_metrics_exist(self):
        missing = SERVING_STATE_METRICS - exported_metrics()
        if missing:
            self.skipTest(f"the daemon does not export {sorted(missing)} "
                          "yet; the rules and dashboard panels on them stay "
                          "empty until it does")

    def test_no_history_or_outside_references(self):
        paths = [os.path.join(REPO, "docs", "operations.md")]
        for root, _, files in os.walk(DEPLOY):
            paths += [os.path.join(root, name) for name in files]
        history = re.compile(r"\b(session|attempt|issue) \d+|#\d+\b",
                             re.IGNORECASE)
        # Upper case: the repository's own docs/design.md may be cited.
        outside = re.compile(r"DESIGN\.md|STYLE\.md|METHOD\.md|ANCHORS\.md")
        for path in paths:
            text = read(path)
            match = history.search(text) or outside.search(text)
            self.assertIsNone(match, f"{path}: {match and match.group(0)}")


if __name__ == "__main__":
    unittest.main()
