"""Renders the kustomizations under deploy/ in Python, for the subset of
kustomize they use (resources, configMapGenerator with
disableNameSuffixHash, labels without selectors, images, patches by path as
strategic merges keyed on "name"), so that the deployment tests run where
no kubectl with kustomize v5 is installed (Debian 12's kubernetes-client
ships kustomize v2, which knows neither `labels` nor `patches`).
test_deploy.py compares this render with `kubectl kustomize` where that is
available. Anything outside the subset raises instead of rendering wrong.
"""

import copy
import os

import yaml

_SUPPORTED = {"apiVersion", "kind", "resources", "configMapGenerator",
              "labels", "images", "patches"}


def _load_docs(path):
    with open(path) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def _merge(base, patch):
    """Strategic merge for the simple case: maps merge, lists of maps with a
    "name" merge by name, other lists and scalars are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = _merge(base[key], value) if key in base else value
        return out
    if (isinstance(base, list) and isinstance(patch, list) and
            all(isinstance(x, dict) and "name" in x for x in base + patch)):
        out = [dict(x) for x in base]
        for item in patch:
            match = [i for i, x in enumerate(out) if x["name"] == item["name"]]
            if match:
                out[match[0]] = _merge(out[match[0]], item)
            else:
                out.append(item)
        return out
    return copy.deepcopy(patch)


def _set_image(containers, images):
    for container in containers:
        for image in images:
            name = image["name"]
            current = container.get("image", "")
            if current == name or current.startswith(name + ":"):
                new = image.get("newName", name)
                tag = image.get("newTag",
                                current[len(name) + 1:] if ":" in current
                                else None)
                container["image"] = f"{new}:{tag}" if tag else new


def build(directory):
    """Returns the list of objects `kustomize build directory` prints."""
    path = os.path.join(directory, "kustomization.yaml")
    with open(path) as f:
        spec = yaml.safe_load(f)
    unknown = set(spec) - _SUPPORTED
    if unknown:
        raise ValueError(f"{path}: unsupported fields {sorted(unknown)}")
    objects = []
    for resource in spec.get("resources", []):
        target = os.path.normpath(os.path.join(directory, resource))
        if os.path.isdir(target):
            objects += build(target)
        else:
            objects += _load_docs(target)
    for generator in spec.get("configMapGenerator", []):
        options = generator.get("options", {})
        if not options.get("disableNameSuffixHash"):
            raise ValueError(f"{path}: name suffix hashes are not rendered")
        data = {}
        for name in generator["files"]:
            with open(os.path.join(directory, name)) as f:
                data[os.path.basename(name)] = f.read()
        metadata = {"name": generator["name"]}
        if options.get("labels"):
            metadata["labels"] = dict(options["labels"])
        objects.append({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": metadata, "data": data})
    for patch in spec.get("patches", []):
        if set(patch) != {"path"}:
            raise ValueError(f"{path}: only patches by path are rendered")
        for doc in _load_docs(os.path.join(directory, patch["path"])):
            key = (doc["kind"], doc["metadata"]["name"])
            hits = [i for i, o in enumerate(objects)
                    if (o["kind"], o["metadata"]["name"]) == key]
            if len(hits) != 1:
                raise ValueError(f"{path}: patch target {key} not found")
            objects[hits[0]] = _merge(objects[hits[0]], doc)
    for entry in spec.get("labels", []):
        if entry.get("includeSelectors") or entry.get("includeTemplates"):
            raise ValueError(f"{path}: only metadata labels are rendered")
        for obj in objects:
            obj["metadata"].setdefault("labels", {}).update(entry["pairs"])
    images = spec.get("images", [])
    for obj in objects:
        pod = obj.get("spec", {}).get("template", {}).get("spec")
        if images and pod:
            _set_image(pod.get("containers", []) +
                       pod.get("initContainers", []), images)
    return objects
