"""When a certificate ends: read by the audit (on a bare host) and by the workers (their metrics)."""

from __future__ import annotations

import base64
import calendar
import re
import time


def not_after(pem: str | None) -> int | None:
    """The end of validity (Unix time) of the first certificate in a PEM file (the fronts' PEMs also
    hold their private key, which is never read past its header), or None where there is none.

    A few lines of DER walking rather than a dependency: the audit runs on hosts with nothing installed.
    """
    match = re.search(r"-----BEGIN CERTIFICATE-----(.*?)-----END CERTIFICATE-----", pem or "", re.S)
    if not match:
        return None
    try:
        der = base64.b64decode("".join(match.group(1).split()))

        def element(offset: int) -> tuple[int, int, int]:  # (tag, start of contents, end)
            tag, length, offset = der[offset], der[offset + 1], offset + 2
            if length & 0x80:
                count = length & 0x7F
                length, offset = int.from_bytes(der[offset : offset + count], "big"), offset + count
            return tag, offset, offset + length

        _, tbs, _ = element(element(0)[1])  # Certificate -> TBSCertificate's contents
        offset = tbs
        if der[offset] == 0xA0:  # [0] version
            offset = element(offset)[2]
        for _ in range(3):  # serialNumber, signature, issuer
            offset = element(offset)[2]
        _, validity, _ = element(offset)
        _, start, end = element(element(validity)[2])  # notBefore, then notAfter
        text = der[start:end].decode("ascii").rstrip("Z")
        if len(text) == 12:  # UTCTime, YYMMDDHHMMSS: years 1950-2049
            text = ("19" if int(text[:2]) >= 50 else "20") + text
        return calendar.timegm(time.strptime(text, "%Y%m%d%H%M%S"))
    except (ValueError, IndexError):
        return None
