module github.com/libfsdp/fsdp-go

go 1.19
