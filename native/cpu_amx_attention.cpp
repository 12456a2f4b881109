// Causal prefill attention for bfloat16 on AMX tiles: one request's chunk of query rows
// against its keys (cached context first, then the chunk's own), GQA without copies of K/V.
//
// Why: torch's flash SDPA runs SmolLM2's 256-token chunks (9 heads of 64) at ~320 GFLOP/s
// where the machine's AMX products reach ~2.8 TFLOP/s. Here both products of each 16-row x
// 32-key block run as AMX tile products, computed transposed (see attend_block): S^T = K.Q^T
// and O^T = V^T.P^T, so that the online softmax between them is lane-wise over the 16 rows.
//
// Per call: each KV head's K rows are copied, zero-padded to a multiple of 32 keys (the A tiles
// of S^T), and its V packed as A tiles of V^T ([32 keys][16 dims]: row i = dim i of the 32
// keys). Then a work item = (KV head, query head of its group, block of 16 query rows), the
// blocks with the most keys first. Query row i sits at position S - Q + i and sees keys
// 0..that position. Scores are scaled in float32; the weights are rounded to bfloat16 for the
// P.V product (as torch's flash SDPA feeds its second GEMM) and summed unrounded; the output
// row is its float32 accumulator over that sum, rounded to bfloat16.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#include "amx.h"
#include "avx512.h"

namespace {

constexpr int kRows = 16;  // query rows per block (the lanes of S^T, one B tile of Q^T)

void load_config() {  // every tile 16 rows x 64 bytes
    const int rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    modserve::configure_tiles(rows);
}

// K rows [S, D] of one head (token stride ks) copied to [S padded to 32][D], zeros past S:
// the A tiles of S^T = K.Q^T read 16 whole rows.
void pack_k(const uint16_t* k, int64_t ks, int S, int D, uint16_t* out) {
    const int padded = (S + 31) / 32 * 32;
    for (int key = 0; key < padded; ++key) {
        if (key < S) {
            std::memcpy(out + static_cast<int64_t>(key) * D, k + key * ks, D * 2);
        } else {
            std::memset(out + static_cast<int64_t>(key) * D, 0, D * 2);
        }
    }
}

// V rows [S, D] of one head as A tiles of O^T = V^T.P^T: for key block b (32 keys) and dims
// block dd (16 dims), tile row i holds dim 16 dd + i of the block's 32 keys (zeros past S).
void pack_vt(const uint16_t* v, int64_t vs, int S, int D, uint16_t* out) {
    const int blocks = (S + 31) / 32, dblocks = D / 16;
    for (int b = 0; b < blocks; ++b)
        for (int t = 0; t < 32; ++t) {
            const int key = b * 32 + t;
            const uint16_t* row = key < S ? v + key * vs : nullptr;
            for (int dd = 0; dd < dblocks; ++dd) {
                uint16_t* tile = out + (static_cast<int64_t>(b) * dblocks + dd) * 512;
                for (int i = 0; i < 16; ++i) tile[i * 32 + t] = row ? row[dd * 16 + i] : 0;
            }
        }
}

// One block of 16 query rows (first at position pos0) of one query head against its KV head
// (kp: packed K rows, vt: packed V^T), computed transposed: S^T = K.Q^T puts the 16 rows in
// the lanes of each key's vector, so the online softmax is lane-wise (no horizontal max or
// sum), and the weights of two keys interleave straight into a row of the B tile of
// O^T = V^T.P^T. O^T is transposed back once at the end.
template <int D>
void attend_block(const uint16_t* q, int64_t qs, int rows, int32_t pos0, const uint16_t* kp, const uint16_t* vt,
                  float scale, uint16_t* out, int64_t os) {
    alignas(64) uint32_t qt[D / 32][16 * 16];  // B tiles of Q^T: row r = dims 2r, 2r+1 of each query row
    alignas(64) float st[32 * 16];             // S^T of a block: 32 keys x 16 rows
    alignas(64) uint16_t pt[16 * 32];          // B tile of P^T: row j = keys 2j, 2j+1 of each query row
    alignas(64) float pv[D * 16];              // O^T of a block: D dims x 16 rows
    alignas(64) float acc[D * 16];             // the running O^T
    for (int db = 0; db < D / 32; ++db)
        for (int r = 0; r < 16; ++r)
            for (int n = 0; n < 16; ++n)
                qt[db][r * 16 + n] = n < rows ? reinterpret_cast<const uint32_t*>(q + n * qs + db * 32)[r] : 0u;
    std::memset(acc, 0, sizeof acc);
    const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32(pos0), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m512i pair_idx = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004, 0x00150005,
                                               0x00160006, 0x00170007, 0x00180008, 0x00190009, 0x001A000A, 0x001B000B,
                                               0x001C000C, 0x001D000D, 0x001E000E, 0x001F000F);  // r0k0 r0k1 r1k0 r1k1 ...
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    __m512 m = ninf, l = _mm512_setzero_ps();
    const int last = pos0 + rows - 1;  // the last row's position: keys 0..last
    const int blocks = last / 32 + 1;
    for (int b = 0; b < blocks; ++b) {
        const int key0 = b * 32;
        _tile_zero(0);
        _tile_zero(1);
        for (int db = 0; db < D / 32; ++db) {
            _tile_loadd(4, kp + static_cast<int64_t>(key0) * D + db * 32, D * 2);
            _tile_loadd(5, kp + static_cast<int64_t>(key0 + 16) * D + db * 32, D * 2);
            _tile_loadd(6, qt[db], 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 5, 6);
        }
        _tile_stored(0, st, 64);
        _tile_stored(1, st + 256, 64);
        __m512 s[32];
        __mmask16 vis[32];
        __m512 bm = ninf;
        for (int t = 0; t < 32; ++t) {
            vis[t] = _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(key0 + t));
            s[t] = _mm512_mask_mov_ps(ninf, vis[t], _mm512_mul_ps(_mm512_load_ps(st + t * 16), vscale));
            bm = _mm512_max_ps(bm, s[t]);
        }
        const __m512 m_new = _mm512_max_ps(m, bm);
        // rows that have seen no key yet keep -inf; 0 stands in so that no -inf - -inf appears
        const __m512 m_safe = _mm512_mask_mov_ps(m_new, _mm512_cmp_ps_mask(m_new, ninf, _CMP_EQ_OQ), _mm512_setzero_ps());
        const __m512 corr = modserve::exp512_nonpositive(_mm512_sub_ps(m, m_safe));
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < 16; ++j) {
            const __m512 p0 = _mm512_maskz_mov_ps(vis[2 * j], modserve::exp512_nonpositive(_mm512_sub_ps(s[2 * j], m_safe)));
            const __m512 p1 = _mm512_maskz_mov_ps(vis[2 * j + 1], modserve::exp512_nonpositive(_mm512_sub_ps(s[2 * j + 1], m_safe)));
            sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
            const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0));  // keys 2j (low), 2j+1 (high)
            _mm512_store_si512(pt + j * 32, _mm512_permutexvar_epi16(pair_idx, both));
        }
        l = _mm512_fmadd_ps(l, corr, sum);
        m = m_new;
        _tile_loadd(6, pt, 64);
        const uint16_t* vb = vt + static_cast<int64_t>(b) * (D / 16) * 512;
        for (int d0 = 0; d0 < D / 16; d0 += 4) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            _tile_loadd(4, vb + (d0 + 0) * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(5, vb + (d0 + 1) * 512, 64);
            _tile_dpbf16ps(1, 5, 6);
            _tile_loadd(4, vb + (d0 + 2) * 512, 64);
            _tile_dpbf16ps(2, 4, 6);
            _tile_loadd(5, vb + (d0 + 3) * 512, 64);
            _tile_dpbf16ps(3, 5, 6);
            _tile_stored(0, pv + (d0 + 0) * 256, 64);
            _tile_stored(1, pv + (d0 + 1) * 256, 64);
            _tile_stored(2, pv + (d0 + 2) * 256, 64);
            _tile_stored(3, pv + (d0 + 3) * 256, 64);
        }
        for (int d = 0; d < D; ++d) {
            _mm512_store_ps(acc + d * 16, _mm512_fmadd_ps(_mm512_load_ps(acc + d * 16), corr, _mm512_load_ps(pv + d * 16)));
        }
    }
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), l);
    for (int d0 = 0; d0 < D; d0 += 16) {
        __m512 blk[16];
        for (int i = 0; i < 16; ++i) blk[i] = _mm512_mul_ps(_mm512_load_ps(acc + (d0 + i) * 16), inv);
        modserve::transpose16x16(blk);  // blk[r]: dims d0 .. d0 + 15 of row r
        for (int r = 0; r < rows; ++r) modserve::store16(out + r * os + d0, blk[r]);
    }
}

template <int D>
void prefill(const uint16_t* q, int64_t qs, const uint16_t* k, const uint16_t* v, int64_t kvs, uint16_t* out, int64_t os,
             int Q, int S, int H, int KVH, float scale, int threads) {
    const int G = H / KVH;
    const int64_t per_head = static_cast<int64_t>((S + 31) / 32 * 32) * D;  // elements of packed K (and of V^T)
    std::vector<uint16_t> kp(per_head * KVH), vt(per_head * KVH);
    const int qblocks = (Q + kRows - 1) / kRows;
    const int items = KVH * G * qblocks;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int h = 0; h < 2 * KVH; ++h) {
            if (h < KVH) {
                pack_k(k + h * D, kvs, S, D, kp.data() + h * per_head);
            } else {
                pack_vt(v + (h - KVH) * D, kvs, S, D, vt.data() + (h - KVH) * per_head);
            }
        }
        load_config();
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; ++item) {
            const int qb = qblocks - 1 - item / (KVH * G);  // the blocks with the most keys first
            const int hq = item % (KVH * G), h = hq / G;
            const int r0 = qb * kRows, rows = Q - r0 < kRows ? Q - r0 : kRows;
            attend_block<D>(q + r0 * qs + hq * D, qs, rows, S - Q + r0, kp.data() + h * per_head, vt.data() + h * per_head,
                            scale, out + r0 * os + hq * D, os);
        }
        _tile_release();
    }
}

}  // namespace

extern "C" {

// 0 when this process may use AMX tiles, -1 when refused, -2 in a build without AMX-BF16.
int modserve_amx_init() { return modserve::request_amx(); }

// Causal attention of Q query rows (q: [Q, H, D], rows qs elements apart) over S keys
// (k, v: [S, KVH, D], rows kvs apart; query row i at position S - Q + i) into out ([Q, H, D],
// rows os apart), all bfloat16. Returns 0, or -1 for a head size other than 64 or 128.
int modserve_amx_prefill(const uint16_t* q, int64_t qs, const uint16_t* k, const uint16_t* v, int64_t kvs, uint16_t* out,
                         int64_t os, int Q, int S, int H, int KVH, int D, float scale, int threads) {
    if (D == 64) {
        prefill<64>(q, qs, k, v, kvs, out, os, Q, S, H, KVH, scale, threads);
    } else if (D == 128) {
        prefill<128>(q, qs, k, v, kvs, out, os, Q, S, H, KVH, scale, threads);
    } else {
        return -1;
    }
    return 0;
}
}

#else

extern "C" {
int modserve_amx_init() { return -2; }
int modserve_amx_prefill(const uint16_t*, int64_t, const uint16_t*, const uint16_t*, int64_t, uint16_t*, int64_t, int, int,
                         int, int, int, float, int) {
    return -1;
}
}

#endif
