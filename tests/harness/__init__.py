"""Throwaway systemd hosts for the tests: systemd-nspawn containers (and QEMU VMs) from one rootfs."""
