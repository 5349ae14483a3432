"""The node tier's images, made without a registry and imported into containerd's ``k8s.io`` namespace.

- the sandbox image: ``pause`` as Kubernetes builds it (``build/pause/linux/pause.c`` of the
  pinned Kubernetes module, compiled static by ``make node-components``), under the name
  containerd 2.4 uses by default (``registry.k8s.io/pause:3.10.2``);
- rdma-cni's: ``conf/Containerfile`` built by ``podman build`` on the offline stand-in for its
  ``debian:12-slim`` base (:func:`tests.runtime.images.glibc_base_tar`), then one layer that
  only sets the simulated node's environment (:func:`rdma_cni_image`);
- Multus': its images' layout (``/usr/src/multus-cni/bin/`` with the daemon, the shims,
  ``install_multus`` and ``passthru``, as ``images/Dockerfile.thick`` copies them, and
  ``/install_multus`` and ``/thin_entrypoint`` as ``images/Dockerfile`` does) on the same base,
  from the binaries built from its module: one image for both of its manifests;
- a busybox image for the test pods (:func:`tests.runtime.images.rootfs_tar`).

Archives are OCI image layouts (ours) or docker archives (``podman save``), both of which
``ctr images import`` takes with their names.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from typing import Any

from tests.runtime.images import glibc_base_tar, rootfs_tar

PAUSE_IMAGE = "registry.k8s.io/pause:3.10.2"  # containerd 2.4's default sandbox image
BUSYBOX_IMAGE = "docker.io/library/rdma-cni-busybox:node"
MULTUS_BIN = "/usr/src/multus-cni/bin"  # where Multus' images keep its binaries
MULTUS_BINARIES = ("multus-daemon", "multus-shim", "install_multus", "passthru", "multus", "thin_entrypoint")


def _tar(files: dict[str, tuple[bytes, int]], dirs: tuple[str, ...] = ()) -> bytes:
    """An uncompressed layer: ``dirs``, then ``files`` (path -> (content, mode)), root-owned, time 0."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type = tarfile.DIRTYPE
            info.mode = 0o755
            tar.addfile(info)
        for name, (data, mode) in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = mode
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _json(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def oci_archive(path: str, name: str, layers: list[bytes], config: dict[str, Any]) -> None:
    """Write an OCI image layout tarball holding one image of ``layers``, named ``name``."""

    def blob(tar: tarfile.TarFile, data: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        info = tarfile.TarInfo("blobs/sha256/" + digest.split(":", 1)[1])
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        return digest

    image_config = _json(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": config,
            "rootfs": {
                "type": "layers",
                "diff_ids": ["sha256:" + hashlib.sha256(la).hexdigest() for la in layers],
            },
        }
    )
    with tarfile.open(path, "w") as tar:
        descriptors = [
            {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": blob(tar, la), "size": len(la)}
            for la in layers
        ]
        config_digest = blob(tar, image_config)
        manifest = _json(
            {
                "schemaVersion": 2,
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {
                    "mediaType": "application/vnd.oci.image.config.v1+json",
                    "digest": config_digest,
                    "size": len(image_config),
                },
                "layers": descriptors,
            }
        )
        index = _json(
            {
                "schemaVersion": 2,
                "manifests": [
                    {
                        "mediaType": "application/vnd.oci.image.manifest.v1+json",
                        "digest": blob(tar, manifest),
                        "size": len(manifest),
                        "annotations": {
                            "io.containerd.image.name": name,
                            "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1],
                        },
                        "platform": {"architecture": "amd64", "os": "linux"},
                    }
                ],
            }
        )
        for member, data in (("index.json", index), ("oci-layout", _json({"imageLayoutVersion": "1.0.0"}))):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def pause_archive(path: str, pause: str) -> str:
    """The sandbox image, with Kubernetes' pause binary as its entrypoint; returns its name."""
    with open(pause, "rb") as f:
        layer = _tar({"pause": (f.read(), 0o755)})
    oci_archive(path, PAUSE_IMAGE, [layer], {"Entrypoint": ["/pause"], "User": "65535:65535"})
    return PAUSE_IMAGE


def busybox_archive(path: str) -> str:
    """Debian's static busybox with ``sh``, ``sleep``, ``ip``, ``cat`` and ``ls``; returns its name."""
    oci_archive(path, BUSYBOX_IMAGE, [rootfs_tar()], {"Cmd": ["sh"], "Env": ["PATH=/bin"]})
    return BUSYBOX_IMAGE


def multus_archive(path: str, name: str, binaries: dict[str, str]) -> str:
    """Multus' thick image layout on the Debian-like base; ``binaries`` maps each of
    :data:`MULTUS_BINARIES` to its built file. Returns ``name``."""
    files = {}
    for binary in MULTUS_BINARIES:
        with open(binaries[binary], "rb") as f:
            files[f"{MULTUS_BIN.lstrip('/')}/{binary}"] = (f.read(), 0o755)
    # The thin image (images/Dockerfile) also has its entry points at the root.
    for binary in ("install_multus", "thin_entrypoint"):
        files[binary] = files[f"{MULTUS_BIN.lstrip('/')}/{binary}"]
    layer = _tar(files, dirs=("usr/src", "usr/src/multus-cni", MULTUS_BIN.lstrip("/")))
    oci_archive(
        path,
        name,
        [glibc_base_tar(), layer],
        {"Entrypoint": [f"{MULTUS_BIN}/multus-daemon"], "Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]},
    )
    return name


def containerfile_sources(containerfile: str) -> list[str]:
    """The context paths ``containerfile``'s COPY lines name."""
    out = []
    with open(containerfile) as f:
        for line in f:
            words = [w for w in line.split() if not w.startswith("--")]
            if words[:1] == ["COPY"]:
                out += words[1:-1]
    assert out, f"{containerfile} copies nothing"
    return out


class ImageBuilder:
    """podman on storage of its own, for ``podman build`` of conf/Containerfile and ``podman save``."""

    def __init__(self, root: str) -> None:
        self.root = root
        # podman refuses a run root longer than 50 characters.
        self.runroot = os.path.join("/run", "rdma-cni-node-podman")
        os.makedirs(self.runroot, exist_ok=True)
        self.conf = os.path.join(root, "containers.conf")
        os.makedirs(root, exist_ok=True)
        with open(self.conf, "w") as f:
            f.write(
                '[engine]\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\n'
                f'events_logfile_path = "{root}/events.log"\nruntime = "runc"\n'
                f'tmp_dir = "{root}/tmp"\nstatic_dir = "{root}/libpod"\nvolume_path = "{root}/volumes"\n'
            )

    def __call__(self, *args: str, timeout: float = 300) -> str:
        """Run podman; its stdout, or AssertionError with its stderr."""
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "CONTAINERS_CONF": self.conf}
        env["HOME"] = self.root
        argv = ["podman", "--root", os.path.join(self.root, "storage"), "--runroot", self.runroot]
        proc = subprocess.run(
            [*argv, "--storage-driver", "overlay", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
        assert proc.returncode == 0, f"podman {' '.join(args)} -> {proc.returncode}: {proc.stderr}"
        return proc.stdout

    def close(self) -> None:
        """Unmount what podman left mounted in its storage (its overlay layers)."""
        self("system", "reset", "--force", timeout=120)
        shutil.rmtree(self.runroot, ignore_errors=True)


def rdma_cni_image(
    builder: ImageBuilder, repo: str, binary: str, shipped_name: str, name: str, env: dict[str, str], out: str
) -> None:
    """Build conf/Containerfile as ``shipped_name`` (on the base stand-in), then ``name`` from it with
    ``env`` set (the simulated node's seams: the one difference), saved as a docker archive ``out``.

    The context holds only what the Containerfile copies (the repository holds .venv); its
    ``dist/rdma-cni`` is ``binary``.
    """
    work = os.path.join(builder.root, "context")
    base_tar = os.path.join(builder.root, "base.tar")
    with open(base_tar, "wb") as f:
        f.write(glibc_base_tar())
    base = "localhost/rdma-cni-base-standin:node"
    builder("import", base_tar, base)
    containerfile = os.path.join(repo, "conf", "Containerfile")
    for source in containerfile_sources(containerfile):
        built = binary if source == "dist/rdma-cni" else os.path.join(repo, source)
        assert os.path.isfile(built), f"{source} is not built: make build"
        os.makedirs(os.path.join(work, os.path.dirname(source)), exist_ok=True)
        shutil.copy(built, os.path.join(work, source))
    builder("build", "--from", base, "-f", containerfile, "-t", shipped_name, work)
    layer = os.path.join(builder.root, "Containerfile.simnode")
    with open(layer, "w") as f:
        f.write(f"FROM {shipped_name}\n")
        f.writelines(f"ENV {key}={value}\n" for key, value in sorted(env.items()))
    builder("build", "-f", layer, "-t", name, builder.root)
    builder("save", "--format", "docker-archive", "-o", out, name)
