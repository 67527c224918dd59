"""LoRA adapters in the Django app (issue 59), in process (pytest-django, a test database): the admin takes
an adapter as a folder path or an uploaded zip (checked: the PEFT files, no path traversal, rank and targets
read), a model's engine command line carries its enabled adapters, and an API key limited to some models is
refused the others. Through a real engine: tests/web/test_lora_stack.py."""

from __future__ import annotations

import io
import json
import stat
import zipfile
from pathlib import Path

import pytest
import redis as redis_client
from django.core.exceptions import ValidationError
from django.test import override_settings
from django.urls import reverse

from inference_engine.__main__ import build_parser
from inference_engine.bus import protocol as P
from inference_engine.bus.redis_server import RedisServer, free_port
from inference_engine.bus.supervisor import serve_command as supervisor_command
from inference_engine.config import engine_flags
from llmserve import lora_files
from llmserve.api.errors import ModelNotFound
from llmserve.bulk.batches import create_batch
from llmserve.bulk.models import BatchFile
from llmserve.engines import engine_target
from llmserve.management.commands.llmserve_engine import serve_command
from llmserve.models import APIKey, LoRAAdapter, ModelConfig
from tests.engine.test_lora import ADAPTERS, write_adapter


@pytest.fixture
def lora_dir(tmp_path: Path):
    unreachable = f"redis://127.0.0.1:{free_port()}/0"  # the admin must work with no engine up
    with override_settings(LLMSERVE={"REDIS_URL": unreachable, "LORA_DIR": str(tmp_path / "store")}):
        yield tmp_path / "store"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peft")
    return {
        name: write_adapter(root / name, *spec, seed=i) for i, (name, spec) in enumerate(ADAPTERS.items())
    }


def _zip(files: dict[str, bytes], links: tuple[str, ...] = ()) -> io.BytesIO:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        for name in links:
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            archive.writestr(info, "/etc/passwd")
    buffer.seek(0)
    buffer.name = "adapter.zip"
    return buffer


def _peft_files(folder: Path, under: str = "") -> dict[str, bytes]:
    return {under + f.name: f.read_bytes() for f in folder.iterdir()}


def _post(admin_client, base: ModelConfig, **fields):
    form = {"name": "customer-a", "base_model": base.pk, "path": "", "enabled": "on", **fields}
    return admin_client.post(reverse("admin:llmserve_loraadapter_add"), form)


@pytest.mark.django_db
def test_admin_upload_of_a_zipped_peft_folder(
    admin_client, lora_dir, folders, django_capture_on_commit_callbacks
) -> None:
    base = ModelConfig.objects.create(name="smol")
    archive = _zip(_peft_files(folders["mlp-o-r8"], under="my-adapter/"))  # zipped as a folder
    response = _post(admin_client, base, archive=archive)
    assert response.status_code == 302, response.content.decode()[:3000]
    adapter = LoRAAdapter.objects.get(name="customer-a")
    # rank_pattern gives down_proj rank 4; the largest rank is the config's r
    assert (adapter.rank, adapter.target_modules) == (8, ["down_proj", "gate_proj", "o_proj", "up_proj"])
    assert adapter.uploaded and Path(adapter.path).parent == lora_dir.resolve()
    assert sorted(p.name for p in Path(adapter.path).iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert (Path(adapter.path) / "adapter_model.safetensors").read_bytes() == (
        folders["mlp-o-r8"] / "adapter_model.safetensors"
    ).read_bytes()
    page = admin_client.get(reverse("admin:llmserve_loraadapter_changelist")).content.decode()
    assert "customer-a" in page and "down_proj, gate_proj, o_proj, up_proj" in page
    # deleting the adapter deletes the folder its upload was extracted to
    with django_capture_on_commit_callbacks(execute=True):
        admin_client.post(reverse("admin:llmserve_loraadapter_delete", args=[adapter.pk]), {"post": "yes"})
    assert not LoRAAdapter.objects.exists() and not Path(adapter.path).exists()
    # so does the folder of an adapter deleted with its base model
    _post(admin_client, base, archive=_zip(_peft_files(folders["qv-r4"])))
    adapter = LoRAAdapter.objects.get(name="customer-a")
    assert Path(adapter.path).is_dir()
    with django_capture_on_commit_callbacks(execute=True):
        base.delete()
    assert not Path(adapter.path).exists()


def _broken_zips(folder: Path) -> dict[str, tuple[io.BytesIO, str]]:
    files = _peft_files(folder)
    config = json.loads(files["adapter_config.json"])
    weights = files["adapter_model.safetensors"]
    return {
        "not a zip": (io.BytesIO(b"PK\x03\x04 not really"), "not a zip file"),
        "no config": (_zip({"adapter_model.safetensors": weights}), "holds no adapter_config.json"),
        "no weights": (_zip({"adapter_config.json": files["adapter_config.json"]}), "no adapter_model"),
        "traversal": (_zip({**files, "../../evil.txt": b"x"}), "points outside the folder"),
        "absolute": (_zip({**files, "/tmp/evil.txt": b"x"}), "points outside the folder"),
        "windows traversal": (_zip({**files, "..\\evil.txt": b"x"}), "points outside the folder"),
        "symlink": (_zip(files, links=("link",)), "symbolic link"),
        "two configs": (_zip({**files, "b/adapter_config.json": b"{}"}), "exactly one adapter_config.json"),
        "dora": (
            _zip({**files, "adapter_config.json": json.dumps({**config, "use_dora": True}).encode()}),
            "DoRA",
        ),
        "other method": (
            _zip({**files, "adapter_config.json": json.dumps({**config, "peft_type": "IA3"}).encode()}),
            "is not LORA",
        ),
        "truncated weights": (_zip({**files, "adapter_model.safetensors": weights[:-10]}), "truncated"),
        "not safetensors": (_zip({**files, "adapter_model.safetensors": b"\xff" * 64}), "not a safetensors"),
    }


@pytest.mark.django_db
def test_admin_refuses_bad_zips_and_extracts_nothing(admin_client, lora_dir, folders) -> None:
    base = ModelConfig.objects.create(name="smol")
    for case, (archive, message) in _broken_zips(folders["qv-r4"]).items():
        archive.name = "adapter.zip"
        response = _post(admin_client, base, archive=archive)
        assert response.status_code == 200, case
        assert message in response.content.decode(), (case, response.content.decode()[-3000:])
    assert not LoRAAdapter.objects.exists()
    assert not lora_dir.exists() or not any(lora_dir.iterdir())  # nothing extracted, not even partly


def test_zip_member_checks_never_write_outside(tmp_path) -> None:
    """Extraction writes the two files under names of its own, whatever the member names say."""
    folder = write_adapter(tmp_path / "a", *ADAPTERS["qv-r4"], seed=1)
    nested = _zip(_peft_files(folder, under="deep/er/"))
    with override_settings(LLMSERVE={"LORA_DIR": str(tmp_path / "store")}):
        extracted = lora_files.AdapterZip(nested).extract("x/y:z")
    assert extracted.parent == (tmp_path / "store").resolve() and "/" not in extracted.name[len("x") :]
    assert sorted(p.name for p in extracted.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


@pytest.mark.django_db
def test_admin_adapter_by_path_and_rank_limit(admin_client, lora_dir, folders, tmp_path) -> None:
    base = ModelConfig.objects.create(name="smol", max_lora_rank=8)
    response = _post(admin_client, base, path=str(folders["all-r16"]))
    assert response.status_code == 200
    assert "rank 16 is above its base model" in response.content.decode()
    response = _post(admin_client, base, path=str(tmp_path / "nowhere"))
    assert "is not a folder on this host" in response.content.decode()
    response = _post(admin_client, base, path=str(folders["qv-r4"]))
    assert response.status_code == 302, response.content.decode()[-3000:]
    adapter = LoRAAdapter.objects.get()
    assert (adapter.path, adapter.uploaded, adapter.rank) == (str(folders["qv-r4"]), False, 4)
    assert adapter.target_modules == ["q_proj", "v_proj"]
    base.max_lora_rank = 2  # below an enabled adapter's rank: refused on the model entry too
    with pytest.raises(ValidationError, match="customer-a has rank 4"):
        base.full_clean()
    # a name clash with a model would make `model` ambiguous
    response = _post(admin_client, base, name="smol", path=str(folders["qv-r4"]))
    assert "A model configuration already has this name" in response.content.decode()


@pytest.mark.django_db
def test_enabled_adapters_reach_the_engine_command_lines(folders) -> None:
    """`manage.py llmserve_engine` and the supervisor's load message both turn the enabled adapters into
    --enable-lora --lora-modules name=path ..., which `serve` parses back."""
    base = ModelConfig.objects.create(name="smol", max_loras=2, max_lora_rank=16)
    assert "enable_lora" not in base.engine_args()  # no adapter: no LoRA
    LoRAAdapter.objects.create(name="off", base_model=base, path=str(folders["mlp-o-r8"]), enabled=False)
    args = base.engine_args()  # LoRA on, so that enabling the adapter loads it without a restart
    assert (args["enable_lora"], args["lora_modules"]) == (True, [])
    assert "--lora-modules" not in engine_flags(args)
    for name, folder in (("b", "all-r16"), ("a", "qv-r4")):
        LoRAAdapter.objects.create(name=name, base_model=base, path=str(folders[folder]))
    args = base.engine_args()
    assert args["lora_modules"] == [f"a={folders['qv-r4']}", f"b={folders['all-r16']}"]
    with override_settings(LLMSERVE={"REDIS_URL": "redis://127.0.0.1:7000/0"}):
        commands = [
            serve_command(base),
            supervisor_command(
                "redis://127.0.0.1:7000/0", "smol", None, args, "llmserve", ["--threads", "1"]
            ),
        ]
    for cmd in commands:
        parsed = build_parser().parse_args(cmd[cmd.index("serve") :])
        assert parsed.lora_modules == args["lora_modules"]
        assert (parsed.enable_lora, parsed.max_loras, parsed.max_lora_rank) == (True, 2, 16)
    assert engine_flags({"lora_modules": []}) == []
    assert engine_flags({"lora_modules": [{"name": "a", "path": "/p"}]}) == [
        "--lora-modules",
        '{"name": "a", "path": "/p"}',
    ]


@pytest.mark.django_db
def test_engine_target_resolves_adapters(folders) -> None:
    base = ModelConfig.objects.create(name="smol")
    LoRAAdapter.objects.create(name="registered", base_model=base, path=str(folders["qv-r4"]))
    served = [P.ModelInfo("smol", [P.ReplicaInfo("r1", "smol", {"lora_modules": ["flagged"]})])]
    assert engine_target("smol", served) == ("smol", None)
    assert engine_target("flagged", served) == ("smol", "flagged")  # served by --lora-modules only
    assert engine_target("registered", []) == ("smol", "registered")  # its engines are down
    assert engine_target("unknown", served) == ("unknown", None)


@pytest.mark.django_db
def test_admin_limits_a_key_to_some_models(admin_client) -> None:
    response = admin_client.post(
        reverse("admin:llmserve_apikey_add"),
        {"name": "customer", "rate_limit": "", "min_priority": "", "allowed_models": "customer-a,\n smol\n"},
    )
    assert response.status_code == 200  # the page that shows the new key once
    key = APIKey.objects.get(name="customer")
    assert key.allowed_models == ["customer-a", "smol"]
    assert key.may_use("customer-a") and not key.may_use("customer-b")
    change = admin_client.get(reverse("admin:llmserve_apikey_change", args=[key.pk])).content.decode()
    assert "customer-a\nsmol" in change
    response = admin_client.post(
        reverse("admin:llmserve_apikey_change", args=[key.pk]),
        {"name": "customer", "rate_limit": "", "min_priority": "", "allowed_models": "bad name!"},
    )
    assert response.status_code == 200 and "Letters, digits" in response.content.decode()
    everything, _ = APIKey.objects.create_key("all")
    assert everything.allowed_models == [] and everything.may_use("anything")


@pytest.mark.django_db(transaction=True)
def test_a_limited_key_is_refused_other_models_before_any_engine_is_asked(client) -> None:
    """The refusal is OpenAI's answer for a model that does not exist (404 model_not_found), on every
    endpoint that takes a `model`; no bus is reachable here, so an allowed model gets past it to the bus."""
    _, raw = APIKey.objects.create_key("limited", allowed_models=["customer-a"])
    headers = {"HTTP_AUTHORIZATION": f"Bearer {raw}"}
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    with override_settings(LLMSERVE={"REDIS_URL": unreachable, "ACK_TIMEOUT": 1.0}):
        for path, body in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/embeddings", {"input": "hi"}),
            ("/v1/responses", {"input": "hi"}),
            ("/tokenize", {"prompt": "hi"}),
        ):
            response = client.post(
                path, {"model": "smol", **body}, content_type="application/json", **headers
            )
            assert response.status_code == 404, (path, response.content)
            error = response.json()["error"]
            assert (error["code"], error["param"]) == ("model_not_found", "model")
            assert "does not exist or you do not have access to it" in error["message"]
        allowed = client.post(
            "/v1/completions",
            {"model": "customer-a", "prompt": "hi"},
            content_type="application/json",
            **headers,
        )
        assert allowed.status_code == 503  # past the key's limit, to the (unreachable) bus
        assert client.get("/v1/models/smol", **headers).status_code == 404


@pytest.mark.django_db
def test_a_limited_key_cannot_batch_other_models() -> None:
    key, _ = APIKey.objects.create_key("limited", allowed_models=["customer-a"])
    line = {
        "custom_id": "1",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "smol", "prompt": "x"},
    }
    upload = BatchFile.objects.create(
        owner=key, purpose="batch", filename="in.jsonl", content=json.dumps(line).encode()
    )
    with pytest.raises(ModelNotFound):
        create_batch(upload, "/v1/completions", owner=key)
    line["body"]["model"] = "customer-a"
    upload.content = json.dumps(line).encode()
    assert create_batch(upload, "/v1/completions", owner=key).job.model == "customer-a"


@pytest.mark.django_db
def test_restart_action_sends_the_supervisor_the_entry_with_its_adapters(admin_client, folders) -> None:
    """An engine started without LoRA (e.g. by scripts/run) serves adapters once restarted from the admin:
    unload, then load with the entry's engine arguments, list-valued lora_modules included."""
    base = ModelConfig.objects.create(name="smol")
    LoRAAdapter.objects.create(name="a", base_model=base, path=str(folders["qv-r4"]))
    redis = RedisServer().start()
    try:
        keys = P.Keys("llmserve")
        client = redis_client.Redis.from_url(redis.url, decode_responses=True)
        client.set(keys.supervisor("default"), "{}")  # a live supervisor, as far as the admin can tell
        with override_settings(LLMSERVE={"REDIS_URL": redis.url}):
            admin_client.post(
                reverse("admin:llmserve_modelconfig_changelist"),
                {"action": "restart_models", "_selected_action": [base.pk]},
            )
        sent = [P.parse(fields) for _, fields in client.xrange(keys.control("default"))]
    finally:
        redis.stop()
    assert [type(m) for m in sent] == [P.Unload, P.Load]
    assert sent[1].engine_args["lora_modules"] == [f"a={folders['qv-r4']}"]
    assert sent[1].engine_args["enable_lora"] is True
