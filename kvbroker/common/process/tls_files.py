"""Reading the TLS files an operator names (a certificate, its private key, a CA) once, up
front, so that a wrong file is one sentence naming it: gRPC refuses a bad key only as "Failed to
bind to address", and the ssl module as "PEM lib", neither saying which file is wrong."""

from __future__ import annotations

import ssl
from pathlib import Path


class TlsFileError(ValueError):
    """A TLS file that cannot be read or does not hold what its flag says."""


def _check_readable(path: Path, what: str) -> None:
    try:
        with path.open("rb"):
            pass
    except OSError as error:
        raise TlsFileError(f"cannot read the {what} file {str(path)!r}: {error.strerror}") from None


def _check_certificates(context: ssl.SSLContext, path: Path, what: str) -> None:
    """Loads ``path`` as trusted certificates: OpenSSL parses every PEM certificate in it, so
    this is also the check that a server's own certificate file holds certificates."""
    _check_readable(path, what)
    try:
        context.load_verify_locations(cafile=str(path))
    except ssl.SSLError:
        raise TlsFileError(f"the {what} file {str(path)!r} holds no PEM certificate") from None


def _refuse_prompt() -> bytes:
    # Without a callback OpenSSL would prompt on the terminal for an encrypted key's password.
    raise TlsFileError("encrypted")


def load_tls_context(
    cert: Path, key: Path, ca: Path | None = None, *, server: bool
) -> ssl.SSLContext:
    """A server's (or a client's) SSLContext holding ``cert`` and its ``key``, trusting ``ca``
    when given; raises TlsFileError naming the file that is missing, unreadable, not what it
    should be, or (the key) not the certificate's."""
    purpose = ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT
    context = ssl.SSLContext(purpose)
    _check_certificates(ssl.SSLContext(purpose), cert, "certificate")
    _check_readable(key, "private key")
    try:
        context.load_cert_chain(str(cert), str(key), password=_refuse_prompt)
    except (ssl.SSLError, TlsFileError) as error:
        if isinstance(error, ssl.SSLError) and error.reason == "KEY_VALUES_MISMATCH":
            raise TlsFileError(
                f"the private key file {str(key)!r} is not the key of the certificate {str(cert)!r}"
            ) from None
        raise TlsFileError(
            f"the private key file {str(key)!r} holds no unencrypted PEM private key"
        ) from None
    if ca is not None:
        _check_certificates(context, ca, "CA")
    return context


def check_certificates(path: Path, what: str = "CA") -> None:
    """Raises TlsFileError unless ``path`` is a readable file of PEM certificates."""
    _check_certificates(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), path, what)
