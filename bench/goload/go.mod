module goload

go 1.19
