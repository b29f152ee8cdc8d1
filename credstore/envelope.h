#pragma once
// Envelope encryption: each secret value is sealed with AES-256-GCM under its own random
// 256-bit data key (DEK); the DEK is wrapped by the master key (KEK) through a KeyProvider.
// The AAD binds the ciphertext to (name, scope, version): a blob moved to another name or
// scope does not decrypt. Plaintext key material is wiped (secure_zero) after use.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "common/base64.h"
#include "common/result.h"
#include "credstore/scope.h"
#include "credstore/secret.h"

namespace egress::credstore {

/// Wraps and unwraps data keys with the KEK. Implementations: a local 32-byte key file
/// (AES-256-GCM key wrap with a random nonce), or an external command (KMS plugin style).
class KeyProvider {
public:
    virtual ~KeyProvider() = default;
    /// Stable id of the KEK (e.g. "file:<first 8 hex of SHA-256(KEK)>"), stored with each
    /// wrapped DEK so rotation can tell which DEKs still use the old KEK.
    virtual std::string key_id() const = 0;
    virtual Result<std::string> wrap(std::string_view dek) = 0;
    /// WARNING: the result holds key bytes; callers wipe it.
    virtual Result<std::string> unwrap(std::string_view wrapped) = 0;
};

/// Opens the KEK file: exactly 32 bytes, mode 0600 or stricter (a group/other-readable file
/// is refused with "keys.master_key_file: <path> is readable by group or others (mode 0644);
/// chmod 600 it"). With `create_if_missing`, creates it (0600, random bytes, parent folder
/// created). The key lives in mlock'ed memory and is wiped on destruction.
Result<std::unique_ptr<KeyProvider>> open_master_key_file(const std::string& path,
                                                          bool create_if_missing);

/// A provider that runs `command wrap` / `command unwrap` (via /bin/sh -c "<command> wrap"),
/// writing the input base64 on stdin and reading the base64 output on stdout, like a
/// Kubernetes KMS plugin. key_id is "kms:" + the first line of `<command> key-id` output.
Result<std::unique_ptr<KeyProvider>> make_kms_command_provider(const std::string& command);

/// A secret at rest: everything base64 except name/scope/metadata. Never holds plaintext.
struct SealedSecret {
    std::string name;
    Scope scope;
    uint64_t version = 1;
    std::string created_at;   // RFC 3339 UTC
    std::string kek_id;
    std::string wrapped_dek;  // base64
    std::string nonce;        // base64, 12 bytes
    std::string ciphertext;   // base64, includes the 16-byte GCM tag at the end
};

/// Validates the plaintext (validate_secret_bytes), seals it under a fresh DEK.
/// `mac_key_out`, when given, receives the record MAC key of the new sealing (below).
Result<SealedSecret> seal(KeyProvider& kek, const std::string& name, const Scope& scope,
                          uint64_t version, std::string_view plaintext,
                          SecretPtr* mac_key_out = nullptr);
/// Unwraps the DEK and decrypts; fails (without detail that could leak) if the blob, its
/// name, scope or version were tampered with. `mac_key_out`, when given, receives the record
/// MAC key of the sealing, once it decrypted.
///
/// The record MAC key authenticates the record a sealing belongs to (a run record, by its
/// sealed CA key: credstore/run_mac.h): HMAC-SHA256(DEK, "egressd record mac v1"). Only a
/// holder of the KEK (or a KMS's unwrap) gets the DEK, so only it can make or check such a
/// MAC; a KEK rotation (rewrap) keeps the DEK, and so the MAC key and every MAC made with it.
Result<SecretPtr> unseal(KeyProvider& kek, const SealedSecret& sealed,
                         SecretPtr* mac_key_out = nullptr);
/// KEK rotation: unwraps the DEK with `from`, wraps it with `to`. The ciphertext and nonce
/// are untouched. On failure, `*record_failed` (when given) is true if the record's side
/// failed (its wrapped DEK does not unwrap with `from`) and false if `to` did not wrap.
Result<SealedSecret> rewrap(KeyProvider& from, KeyProvider& to, const SealedSecret& sealed,
                            bool* record_failed = nullptr);

/// SHA-256 of `bytes`, lowercase hex (OpenSSL EVP).
std::string sha256_hex(std::string_view bytes);
/// HMAC-SHA256 of `data` under `key`, 32 raw bytes (OpenSSL EVP_MAC); empty if OpenSSL fails.
std::string hmac_sha256(std::string_view key, std::string_view data);

/// Base64 helpers (OpenSSL EVP), shared by the store: the one encoder (common/base64.h), and
/// a strict decoder.
using egress::base64_encode;
Result<std::string> base64_decode(std::string_view text);

}  // namespace egress::credstore
