"""TLS and SuperNode authentication of a local deployment (pipeline.federation.localhost): a throwaway CA with the
SuperLink's certificate, and a SuperNode's key pair."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from pipeline.common import atomic
from pipeline.federation.processes import HOST, FederationError


@dataclass(frozen=True)
class Certificates:
    """TLS files of a SuperLink and the CA that signed it (the SuperNodes' and the CLI's ``root-certificates``)."""

    ca: Path
    cert: Path
    key: Path


def tail(text: object) -> str:  # the end of a command's output or error, on one line (localhost's errors too)
    return " ".join(str(text).split())[-300:]


def _run(*argv) -> None:
    out = subprocess.run([str(a) for a in argv], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        raise FederationError(f"`{' '.join(map(str, argv[:2]))}` failed: {tail(out.stderr)}")


def make_self_signed_ca(out: Path, days: int = 2) -> Certificates:
    """A throwaway CA and a certificate for the SuperLink on 127.0.0.1 signed by it."""
    out.mkdir(parents=True, exist_ok=True)
    certs = Certificates(out / "ca.crt", out / "server.pem", out / "server.key")
    new_key = "openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-384 -nodes".split()
    _run(*new_key, "-x509", "-days", days, "-subj", "/CN=fedmeet local CA", "-keyout", out / "ca.key", "-out", certs.ca)
    _run(*new_key, "-subj", f"/CN={HOST}", "-keyout", certs.key, "-out", out / "server.csr")
    atomic.write_text(out / "san.cnf", f"subjectAltName=IP:{HOST},DNS:localhost\n")
    sign = ["openssl", "x509", "-req", "-in", out / "server.csr", "-extfile", out / "san.cnf", "-out", certs.cert]
    _run(*sign, "-CA", certs.ca, "-CAkey", out / "ca.key", "-CAcreateserial", "-days", days)
    return certs


def make_node_key(out: Path, name: str) -> tuple[Path, Path]:
    """A SuperNode's authentication key pair: (private key the SuperNode keeps, public key the server registers)."""
    out.mkdir(parents=True, exist_ok=True)
    private, public = out / name, out / f"{name}.pub"
    for key in (private, public):
        key.unlink(missing_ok=True)  # ssh-keygen would ask before overwriting
    _run("ssh-keygen", "-q", "-t", "ecdsa", "-b", "384", "-N", "", "-f", private)
    return private, public
