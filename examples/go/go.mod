module github.com/libfsdp/fsdp-go/examples

go 1.19

require github.com/libfsdp/fsdp-go v0.0.0

replace github.com/libfsdp/fsdp-go => ../../bindings/go
