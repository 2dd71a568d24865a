"""HTTPS for ``serve --tls``: a self-signed certificate made on first use and kept in the user's
cache folder, so that a phone that accepted it once accepts it again after a restart.

A browser grants a page a secure context (Web Crypto, cross-origin isolation and with it
onnxruntime-web's threads) only over HTTPS or on localhost; another device on the local network
reaches the server by its address, over plain HTTP unless ``--tls`` is given. The certificate is
self-signed, so the browser asks once whether to trust it: compare the SHA-256 fingerprint it
shows with the one ``serve`` prints. ``--cert``/``--key`` take a certificate of your own (for
example from mkcert, which a browser trusts without asking).
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import ssl
from pathlib import Path

VALID_DAYS = 365
RENEW_DAYS = 7  # a cached certificate this close to its end is made anew


def cache_folder() -> Path:
    """Where the generated certificates are kept (``$XDG_CACHE_HOME/nefl-zoo/tls``)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "nefl-zoo" / "tls"


def certificate_names(host: str) -> list[str]:
    """The names a certificate for a server bound to ``host`` covers: localhost, the loopback
    addresses, this machine's name and ``host`` itself unless it is a wildcard address."""
    import socket

    names = ["localhost", "127.0.0.1", "::1", socket.gethostname()]
    if host not in ("0.0.0.0", "::", "") and host not in names:
        names.append(host)
    return names


def self_signed(names: list[str], folder: Path | None = None) -> tuple[Path, Path]:
    """The certificate and key files of a self-signed certificate for ``names`` (made, or reused
    from the cache while it has more than :data:`RENEW_DAYS` left)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder = cache_folder() if folder is None else folder
    stem = hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]
    cert_path, key_path = folder / f"{stem}.crt", folder / f"{stem}.key"
    now = datetime.datetime.now(datetime.timezone.utc)
    if cert_path.is_file() and key_path.is_file():
        cached = x509.load_pem_x509_certificate(cert_path.read_bytes())
        if cached.not_valid_after_utc - now > datetime.timedelta(days=RENEW_DAYS):
            return cert_path, key_path
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "nefl-zoo serve")])
    alternatives = []
    for name in names:
        try:
            alternatives.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alternatives.append(x509.DNSName(name))
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(alternatives), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    key_bytes = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    _write_private(key_path, key_bytes)
    _write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` readable by this user only, whole or not at all (a rename)."""
    temporary = path.with_suffix(path.suffix + ".tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(data)
    os.replace(temporary, path)


def fingerprint(cert_path: Path) -> str:
    """The SHA-256 fingerprint of a PEM certificate as browsers show it (``AB:CD:...``)."""
    der = ssl.PEM_cert_to_DER_cert(cert_path.read_text(encoding="ascii"))
    digest = hashlib.sha256(der).hexdigest().upper()
    return ":".join(digest[i:i + 2] for i in range(0, len(digest), 2))


def server_context(cert_path: Path, key_path: Path) -> ssl.SSLContext:
    """A TLS server context (TLS 1.2 or newer) of the certificate and key."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_path, key_path)
    return context


def options_context(tls: bool, cert: Path | None, key: Path | None, host: str) -> tuple[ssl.SSLContext | None, str | None]:
    """The TLS context ``serve``'s options ask for and its certificate's fingerprint (``None,
    None``: plain HTTP); a one-line ``ValueError`` for a certificate that cannot be used."""
    if (cert is None) != (key is None):
        raise ValueError("--cert and --key: give both (a certificate and its private key), or neither")
    if cert is None and not tls:
        return None, None
    if cert is None:
        cert, key = self_signed(certificate_names(host))
    try:
        return server_context(cert, key), fingerprint(cert)
    except (ssl.SSLError, ValueError, OSError) as exc:
        raise ValueError(f"--cert {cert} --key {key}: not a PEM certificate and its private key ({exc})") from None


__all__ = ["cache_folder", "certificate_names", "fingerprint", "options_context", "self_signed", "server_context"]
