"""Test certificates and SuperNode keys for a secure Flower deployment.

``generate_certificates(folder)`` writes, with the ``cryptography`` package (a dependency of
Flower):

========================  ==================================================================
``ca.crt``, ``ca.key``    a self-signed test certificate authority (ECDSA P-256)
``server.crt``,           the SuperLink's TLS certificate, signed by the CA, valid for
``server.key``            ``localhost`` and ``127.0.0.1`` (and any extra ``hosts``)
``supernode-<i>``,        one key pair per SuperNode for Flower's SuperNode authentication
``supernode-<i>.pub``     (ECDSA P-384, OpenSSH format, as ``flower-supernode
                          --auth-supernode-private-key`` and ``flwr supernode register``
                          expect)
========================  ==================================================================

These are for test federations. For a real one, bring certificates from your own CA in the
same layout (``fedhier deploy local --certs DIR``); see docs/deployment.md.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedhier.common.errors import ConfigError

#: Names the server certificate is valid for by default (loopback only).
DEFAULT_HOSTS = ("localhost", "127.0.0.1")
CA_CERT, CA_KEY = "ca.crt", "ca.key"
SERVER_CERT, SERVER_KEY = "server.crt", "server.key"


@dataclass(frozen=True)
class Certificates:
    """Paths of one federation's TLS material (and SuperNode keys, if any)."""

    folder: Path
    ca_cert: Path
    server_cert: Path
    server_key: Path
    ca_key: Path | None = None
    supernode_keys: tuple[Path, ...] = ()  # private keys; the public key is ``<key>.pub``

    @classmethod
    def from_folder(cls, folder: str | Path, num_supernodes: int = 0) -> Certificates:
        """Certificates found in ``folder`` (``ca.crt``, ``server.crt``, ``server.key``).

        SuperNode keys ``supernode-<i>`` / ``supernode-<i>.pub`` are picked up when all
        ``num_supernodes`` of them exist. Raises ConfigError for a missing file.
        """
        folder = Path(folder)
        if not folder.is_dir():
            raise ConfigError(f"certificate folder {folder} does not exist")
        paths = {name: folder / name for name in (CA_CERT, SERVER_CERT, SERVER_KEY)}
        missing = [name for name, path in paths.items() if not path.is_file()]
        if missing:
            raise ConfigError(f"certificate folder {folder} lacks {', '.join(missing)} "
                              f"(expected {CA_CERT}, {SERVER_CERT}, {SERVER_KEY})")
        keys = tuple(folder / f"supernode-{i}" for i in range(num_supernodes))
        have_keys = bool(keys) and all(k.is_file() and k.with_name(k.name + ".pub").is_file()
                                       for k in keys)
        ca_key = folder / CA_KEY
        return cls(folder, paths[CA_CERT], paths[SERVER_CERT], paths[SERVER_KEY],
                   ca_key if ca_key.is_file() else None, keys if have_keys else ())


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if private:  # created 0600 from the start: never world-readable, even briefly
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
    else:
        path.write_bytes(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM,
                             serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedhier test federation"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_ca(common_name: str = "fedhier test CA",
            days: int = 30) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A self-signed CA key and certificate."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(common_name)
    start = _now() - dt.timedelta(minutes=5)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(start + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def make_server_cert(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate,
                     hosts: Sequence[str] = DEFAULT_HOSTS,
                     days: int = 30) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A TLS server key and certificate signed by the CA, valid for ``hosts``."""
    if not hosts:
        raise ConfigError("the server certificate needs at least one host name or address")
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    start = _now() - dt.timedelta(minutes=5)
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0])).issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(start + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False,
                                     key_cert_sign=False, crl_sign=False,
                                     content_commitment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False,
                                     decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def make_supernode_key(path: str | Path, comment: str = "") -> tuple[Path, Path]:
    """Write an ECDSA P-384 key pair in OpenSSH format: ``path`` and ``path.pub``."""
    path = Path(path)
    key = ec.generate_private_key(ec.SECP384R1())
    private = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                           serialization.PublicFormat.OpenSSH)
    if comment:
        public += b" " + comment.encode()
    _write(path, private, private=True)
    public_path = path.with_name(path.name + ".pub")
    _write(public_path, public + b"\n")
    return path, public_path


def generate_certificates(folder: str | Path, num_supernodes: int = 0,
                          hosts: Sequence[str] = DEFAULT_HOSTS, days: int = 30) -> Certificates:
    """Write a test CA, a SuperLink certificate for ``hosts`` and SuperNode key pairs."""
    folder = Path(folder)
    ca_key, ca_cert = make_ca(days=days)
    server_key, server_cert = make_server_cert(ca_key, ca_cert, hosts, days=days)
    pem = serialization.Encoding.PEM
    _write(folder / CA_KEY, _key_pem(ca_key), private=True)
    _write(folder / CA_CERT, ca_cert.public_bytes(pem))
    _write(folder / SERVER_KEY, _key_pem(server_key), private=True)
    _write(folder / SERVER_CERT, server_cert.public_bytes(pem))
    keys = tuple(make_supernode_key(folder / f"supernode-{i}", comment=f"supernode-{i}")[0]
                 for i in range(num_supernodes))
    return Certificates(folder, folder / CA_CERT, folder / SERVER_CERT, folder / SERVER_KEY,
                        folder / CA_KEY, keys)
