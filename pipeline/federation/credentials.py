"""TLS and authentication material of a local deployment: a throwaway CA with a SuperLink certificate signed
by it, and the SuperNodes' authentication key pairs (localhost runs and tests only)."""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from pipeline.common import atomic
from pipeline.federation.processes import HOST


@dataclass(frozen=True)
class Certificates:
    """TLS files of a SuperLink: its certificate and key, and the CA that signed it (given to the SuperNodes and
    the CLI connection as ``root-certificates``)."""

    ca: Path
    cert: Path
    key: Path


def make_self_signed_ca(out: Path, host: str = HOST, days: int = 2) -> Certificates:
    """A throwaway CA and a server certificate for ``host`` signed by it (localhost runs and tests only)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedmeet local CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
          .not_valid_after(now + dt.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False),
                         critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP384R1())
    try:
        san = [x509.IPAddress(ipaddress.ip_address(host))]
    except ValueError:
        san = [x509.DNSName(host)]
    if host == HOST:
        san.append(x509.DNSName("localhost"))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(san), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    certs = Certificates(out / "ca.crt", out / "server.pem", out / "server.key")
    atomic.write_bytes(certs.ca, ca.public_bytes(serialization.Encoding.PEM))
    atomic.write_bytes(certs.cert, cert.public_bytes(serialization.Encoding.PEM))
    atomic.write_bytes(certs.key, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                    serialization.NoEncryption()))
    certs.key.chmod(0o600)
    return certs


def make_node_key(out: Path, name: str) -> tuple[Path, Path]:
    """A SuperNode's authentication key pair (EC P-384, OpenSSH format, as ``ssh-keygen -t ecdsa -b 384`` writes):
    the SuperNode keeps the private key, the federation owner registers the public one."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = out / name, out / f"{name}.pub"
    atomic.write_bytes(private, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                                  serialization.NoEncryption()))
    private.chmod(0o600)
    atomic.write_bytes(public, key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                             serialization.PublicFormat.OpenSSH) + b"\n")
    return private, public
