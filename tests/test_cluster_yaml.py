"""cluster.yaml passes Ray's own cluster-config validation and keeps credentials out."""

import os

import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load():
    with open(os.path.join(ROOT, "cluster.yaml")) as f:
        return yaml.safe_load(f)


def test_cluster_yaml_is_valid_for_ray_up():
    config = load()
    # What `ray up` does before launching: fill in defaults, then validate the schema.
    validate_config(prepare_config(config))
    assert config["provider"]["type"] == "aws"
    assert set(config["available_node_types"]) == {"head", "worker"}
    # The head's autoscaler needs boto3; the list replaces Ray's default that installs it.
    assert any("boto3" in c and ".venv/bin/python -m pip install" in c
               for c in config["head_setup_commands"])


def test_cluster_yaml_has_no_keys_and_uses_an_instance_profile():
    text = open(os.path.join(ROOT, "cluster.yaml")).read()
    assert "aws_access_key_id" not in text.lower() and "aws_secret" not in text.lower()
    for node in load()["available_node_types"].values():
        assert "IamInstanceProfile" in node["node_config"]


def test_local_cluster_yaml_is_valid_and_installs_the_project():
    with open(os.path.join(ROOT, "cluster-local.yaml")) as f:
        config = yaml.safe_load(f)
    validate_config(prepare_config(config))
    assert config["provider"] == {"type": "local", "head_ip": "127.0.0.1", "worker_ips": []}
    assert any("./dev setup" in c for c in config["setup_commands"])
    assert ".venv" in config["rsync_exclude"]


def test_cluster_yaml_nodes_set_up_like_a_developer_s_machine():
    """Each node runs ./dev setup (Python 3.11, the pinned packages and the Spark jar, built
    with Maven) and gets the checkout without its local virtualenv or build."""
    config = load()
    commands = " ".join(config["setup_commands"])
    assert "./dev setup" in commands and "maven" in commands and "3.11" in commands
    assert {".venv", ".git", "jvm/target"} <= set(config["rsync_exclude"])
    starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    assert all("~/venv/" not in c for c in starts)


def test_cluster_yamls_pass_rays_schema_as_written_and_can_reach_every_worker():
    """Ray's schema, before ``prepare_config`` fills in the provider's defaults, requires a
    ``cluster_name``; and the top-level ``max_workers`` those defaults give (2 on AWS) caps
    every worker type: cluster.yaml's ``worker`` type allowed 4, the autoscaler started 2."""
    import json

    import jsonschema
    import ray

    schema_path = os.path.join(os.path.dirname(ray.__file__), "autoscaler", "ray-schema.json")
    with open(schema_path) as f:
        schema = json.load(f)
    for name in ("cluster.yaml", "cluster-local.yaml"):
        with open(os.path.join(ROOT, name)) as f:
            config = yaml.safe_load(f)
        jsonschema.validate(config, schema)
        filled = prepare_config(config)
        most = sum(t.get("max_workers", 0) for n, t in filled["available_node_types"].items()
                   if n != filled["head_node_type"])
        assert filled["max_workers"] >= most, (name, filled["max_workers"], most)
