"""The names the service, the roles, the templates and the tests share, each spelled here once.

It sits in the sizing package, the ground floor, because that package ships alone to hosts that
have nothing installed (Ansible module_utils) and every other layer may import it: the settings'
choices, the CLI's, the roles' argument specs (tests/test_ansible.py checks them against these) and
the status lines that tests and operators read all come from here. Standard library only.
"""

from __future__ import annotations

# Quantize levels, from the most memory to the least: the exact weights, llama.cpp's Q8_0 (int8),
# 4-bit groups of 32 (int4). `auto` lets the plan choose among them.
QUANTIZE_LEVELS = ("none", "int8", "int4")
QUANTIZED_LEVELS = QUANTIZE_LEVELS[1:]
AUTO = "auto"
FLOAT_DTYPES = ("bfloat16", "float32")  # the model's dtype (and the vision tower's, the prompts')

# Every setting of a worker is an environment variable with this prefix (the units' environment files).
ENV_PREFIX = "VLSERVE_"

# The API client a request came from, by its name in the key set: the front sets this header itself
# (dropping any copy the client sent) and the workers label their usage metrics with it.
CLIENT_HEADER = "X-Vlserve-Client"
CLIENT_NAME = r"^[a-z0-9][a-z0-9_.-]{0,47}$"

# Each request's ID, from the first front it reaches to the worker's journal: a front keeps an ID the
# client sent when it matches REQUEST_ID (a bounded, log-safe alphabet), otherwise it makes one; the
# worker does the same for a request that reached it directly.
REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID = r"^[A-Za-z0-9._:-]{8,128}$"

# Where the fronts keep their TLS files on a host (the roles install them, the templates name them,
# the audit reads their expiry). PEMs with a private key are 0640 root:haproxy.
TLS_DIR = "/etc/vlserve/tls"
FRONT_PEM = TLS_DIR + "/front.pem"  # a host front's certificate chain and key
FLEET_PEM = TLS_DIR + "/fleet.pem"  # the fleet front's
FLEET_BACKEND_CA = TLS_DIR + "/fleet-backends-ca.crt"  # what the fleet front checks host fronts against
# Mutual TLS between them: the fleet front's client certificate (chain and key), and on each host
# the CA a client certificate must chain to. Its subject's common name starts with FLEET_CLIENT_CN.
FLEET_CLIENT_PEM = TLS_DIR + "/fleet-client.pem"
FLEET_CLIENTS_CA = TLS_DIR + "/fleet-clients-ca.crt"
FLEET_CLIENT_CN = "vlserve fleet front"
# The monitoring host's client certificate (same CA, same file on the hosts): its name starts so, and
# the fronts' metrics port answers it alone.
MONITORING_CLIENT_CN = "vlserve monitoring"
FRONT_CERTIFICATES = (FRONT_PEM, FLEET_PEM, FLEET_CLIENT_PEM)
# The host front's certificate chain again, without its key and readable by all: the workers export
# its end of validity (vlserve_certificate_not_after_seconds) for the expiry alert.
FRONT_PUBLIC_CERTIFICATE = "/etc/vlserve/front.crt"
# A certificate with fewer days left is signed again by the play, and the audit calls it drift.
CERTIFICATE_RENEW_DAYS = 30

# How /readyz, /status and the benchmarks say which kernels serve the products: vlserve's own, at an
# ISA tier, or torch's with the reason.
KERNELS_OWN = "vlserve's kernels for "
KERNELS_STOCK = "stock kernels: "
